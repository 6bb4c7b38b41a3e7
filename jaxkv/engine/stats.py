"""EngineStats: the numbers `LLM.stats()` reports (counters exclude warmup)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


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
    num_compilations: int          # programs compiled by the engine (warmup and background included)
    num_running: int
    num_waiting: int
    tensor_parallel_size: int = 1                 # devices the step is split over
    num_processes: int = 1                        # processes holding them (multi-process)
    attention_backend: str = ""                   # "cpu" | "xla" | "pallas", as resolved
    # The decoder layers' weights format (vLLM's --quantization name: fp8, awq, gptq,
    # compressed-tensors; None: the model's dtype) and the bytes all the weights hold on the
    # devices (every shard; quantized layers as packed).
    quantization: str | None = None
    weights_bytes: int = 0
    # A mixture of experts: the real tokens each expert took, summed over its MoE layers and
    # every step so far, and their imbalance: the busiest expert's count over the mean (1.0:
    # perfectly even; None before any step or for a dense model).
    moe_expert_tokens: tuple[int, ...] = ()
    moe_load_imbalance: float | None = None
    # Engine steps that ran a batch, the CPU seconds of the engine thread in them (the host's
    # work per step: scheduling, inputs, dispatch, applying the sampled tokens; waiting for
    # the device costs none), and the CPU seconds of output processing (detokenizing, stop
    # strings, RequestOutputs: on AsyncLLM's output thread, or in LLMEngine.step's caller).
    num_steps: int = 0
    host_cpu_seconds: float = 0.0
    output_cpu_seconds: float = 0.0
    # A model whose every layer is windowed: the window behind which the KV cache manager
    # frees a sequence's blocks (None: every block is kept), and the blocks freed so far.
    kv_sliding_window: int | None = None
    num_window_freed_blocks: int = 0
    # Steps (and sampler calls) of at most this many rows run their float32 matmuls through
    # jaxkv's C++ kernel (the cpu backend on one device; jaxkv/cpu_kernels/linear.py); 0: off.
    cpu_matmul_max_rows: int = 0
    # Fused sampling (jaxkv/sampling/fused_sampling.py): the step programs of token buckets up
    # to this size sample a plain step's tokens themselves (0: none do; 2**30: every bucket),
    # and the steps that sampled that way.
    fused_sampling_max_tokens: int = 0
    num_fused_sampling_steps: int = 0
    # Async scheduling (jaxkv/runner/lookahead.py): on or off, decode steps dispatched ahead
    # of the scheduler, those whose result some sequence took (used) and those none did
    # (discarded: every sequence changed course, e.g. all stopped), each counted when the next
    # step arrives (so the last one dispatched may be neither yet).
    async_scheduling: bool = False
    num_async_steps: int = 0
    num_async_steps_used: int = 0
    num_async_steps_discarded: int = 0
    # Of num_async_steps_used, those the steady batch's fast path took (its rows asked as
    # predicted, some perhaps dropped or joined by others; jaxkv/runner/steady_batch.py).
    num_async_steps_steady: int = 0
    # Of num_async_steps, those dispatched from the launcher's thread, off the engine thread
    # (jaxkv/runner/launcher.py: fused single steps and k-step programs).
    num_launched_steps: int = 0
    # Multi-step decode (jaxkv/runner/multi_step.py): num_scheduler_steps, and the engine
    # steps that ran more than one decode step in one program (not in num_fused_sampling_steps).
    num_scheduler_steps: int = 1
    num_multi_steps: int = 0
    token_buckets: tuple[int, ...] = ()           # every padded token count of a step
    compiled_token_buckets: tuple[int, ...] = ()  # those compiled so far: steps pad to these
    # Speculative decoding (vLLM's spec_decode_* counters; zero when it is off): requests
    # given a draft in a step, draft tokens, accepted ones, accepted ones per draft position,
    # and accepted / draft tokens (None before any draft).
    # Structured outputs: constrained sequences added, their grammars' matchers built, and the
    # seconds those builds took (on the grammar thread pool, off the step loop).
    # KV cache tiers (zero when off; jaxkv/core/host_tier.py, disk_tier.py): each tier's
    # capacity and used blocks, prompt tokens found there, blocks copied into it (stored) and
    # back to the device (loaded); preemptions that swapped a request's blocks out.
    kv_offload_host_blocks: int = 0
    kv_offload_host_used_blocks: int = 0
    kv_offload_host_hit_tokens: int = 0
    kv_offload_host_stored_blocks: int = 0
    kv_offload_host_loaded_blocks: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_disk_used_blocks: int = 0
    kv_offload_disk_hit_tokens: int = 0
    kv_offload_disk_stored_blocks: int = 0
    kv_offload_disk_loaded_blocks: int = 0
    num_swapped_out: int = 0
    num_structured_output_requests: int = 0
    num_grammars_compiled: int = 0
    grammar_compile_seconds: float = 0.0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    spec_decode_acceptance_rate: float | None = None

    @property
    def num_token_buckets(self) -> int:
        return len(self.token_buckets)

    @property
    def num_compiled_token_buckets(self) -> int:
        return len(self.compiled_token_buckets)

    def to_dict(self) -> dict:
        return asdict(self)


def tier_stats(scheduler) -> dict:
    """The KV tiers' EngineStats fields (none without a host or disk tier)."""
    kv, out = scheduler.kv, {}
    for name, tier in (("host", kv.host), ("disk", kv.disk)):
        if tier is not None:
            out.update({f"kv_offload_{name}_blocks": tier.max_blocks,
                        f"kv_offload_{name}_used_blocks": tier.num_used,
                        f"kv_offload_{name}_hit_tokens": getattr(kv, f"{name}_hit_tokens"),
                        f"kv_offload_{name}_stored_blocks": tier.num_stored,
                        f"kv_offload_{name}_loaded_blocks": tier.num_loaded})
    if out:
        out["num_swapped_out"] = scheduler.num_swapped_out
    return out


def moe_stats(runner) -> dict:
    """A mixture of experts' fields: tokens per expert and the load imbalance."""
    load = getattr(runner, "expert_load", None)
    if load is None:
        return {}
    tokens = [int(x) for x in np.asarray(load)]
    mean = sum(tokens) / len(tokens)
    return {"moe_expert_tokens": tuple(tokens),
            "moe_load_imbalance": max(tokens) / mean if mean else None}


def spec_stats(scheduler) -> dict:
    """Speculative decoding's fields (none without a proposer)."""
    sd = getattr(scheduler, "spec_stats", None)
    if sd is None:
        return {}
    return dict(spec_decode_num_drafts=sd.num_drafts,
                spec_decode_num_draft_tokens=sd.num_draft_tokens,
                spec_decode_num_accepted_tokens=sd.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=tuple(sd.num_accepted_tokens_per_pos),
                spec_decode_acceptance_rate=(sd.num_accepted_tokens / sd.num_draft_tokens
                                             if sd.num_draft_tokens else None))
