"""EngineStats: the numbers `LLM.stats()` reports (counters exclude warmup)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    num_total_blocks: int          # usable blocks (null block excluded)
    num_free_blocks: int           # includes cached blocks no request holds
    kv_cache_usage: float          # 1 - free / total
    prefix_cache_queries: int      # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int         # of those, tokens found
    num_prompt_tokens: int         # prompt tokens of all requests added
    num_computed_prompt_tokens: int  # prompt tokens run through the model (recompute included)
    num_generation_tokens: int     # tokens sampled
    num_preemptions: int           # requests preempted
    num_compilations: int          # backend compiles of the engine's jitted functions (warmup included)
    num_running: int
    num_waiting: int

    def to_dict(self) -> dict:
        return asdict(self)
