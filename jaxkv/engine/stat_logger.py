"""The periodic throughput log line, in the shape of vLLM's LoggingStatLogger.

Every `interval_s` seconds while the engine has work (or did some since the last line):

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, Preemptions: 0, KV cache usage: 41.2%,
    Prefix cache hit rate: 37.5%, Compiled token buckets: 7/10, Structured output requests: 4

Prompt throughput counts prompt tokens run through the model (prefix-cache hits excluded,
recompute after preemption included); the hit rate is over the prompt tokens looked up since
the previous line (lifetime when none were). The last field counts the token buckets whose
programs are compiled (the others are still compiling in the background; steps pad to the
compiled ones); the structured-output field (requests added in the interval) appears once
any came; with the KV cache's host and disk tiers, each tier's usage and the prompt tokens
found there in the interval follow. With speculative decoding a second line follows, as vLLM's:

    SpecDecoding metrics: Mean acceptance length: 2.85, Accepted throughput: 30.12 tokens/s,
    Drafted throughput: 48.40 tokens/s, Accepted: 151 tokens, Drafted: 242 tokens,
    Per-position acceptance rate: 0.774, 0.613, 0.484, 0.323, Avg Draft acceptance rate: 62.4%

(mean acceptance length = 1 + accepted / drafts: tokens a drafted step yields).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("jaxkv")


class LoggingStatLogger:
    def __init__(self, interval_s: float = 5.0, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.last_time = 0.0
        self.last = None

    def maybe_log(self, stats) -> str | None:
        """Log (and return) one line if interval_s has passed and there was work."""
        now = self.clock()
        if self.last is None:
            self.last, self.last_time = stats, now
        if now - self.last_time < self.interval_s:
            return None
        prev = self.last
        self.last, dt, self.last_time = stats, now - self.last_time, now
        d_prompt = stats.num_computed_prompt_tokens - prev.num_computed_prompt_tokens
        d_gen = stats.num_generation_tokens - prev.num_generation_tokens
        busy = stats.num_running or stats.num_waiting or d_prompt or d_gen
        if not busy:
            return None
        d_q = stats.prefix_cache_queries - prev.prefix_cache_queries
        d_h = stats.prefix_cache_hits - prev.prefix_cache_hits
        if d_q == 0:
            d_q, d_h = stats.prefix_cache_queries, stats.prefix_cache_hits
        line = (f"Avg prompt throughput: {d_prompt / dt:.1f} tokens/s, "
                f"Avg generation throughput: {d_gen / dt:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"Preemptions: {stats.num_preemptions}, "
                f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * d_h / d_q if d_q else 0.0:.1f}%")
        if stats.token_buckets:
            line += (f", Compiled token buckets: {len(stats.compiled_token_buckets)}/"
                     f"{len(stats.token_buckets)}")
        d_steps = stats.num_steps - prev.num_steps
        if d_steps:
            line += (f", Host CPU: {1e3 * (stats.host_cpu_seconds - prev.host_cpu_seconds) / d_steps:.2f}"
                     f" ms/step (outputs: {1e3 * (stats.output_cpu_seconds - prev.output_cpu_seconds) / d_steps:.2f})")
        if stats.kv_sliding_window is not None:
            line += (f", Blocks freed behind the window: "
                     f"{stats.num_window_freed_blocks - prev.num_window_freed_blocks}")
        if stats.moe_load_imbalance is not None:
            line += f", MoE load imbalance: {stats.moe_load_imbalance:.2f}"
        if stats.async_scheduling:
            line += self._async_part(stats, prev)
        if stats.num_scheduler_steps > 1:
            line += f", Multi-steps: {stats.num_multi_steps - prev.num_multi_steps}/{d_steps}"
        d_so = stats.num_structured_output_requests - prev.num_structured_output_requests
        if stats.num_structured_output_requests:
            line += f", Structured output requests: {d_so}"
        for tier in ("host", "disk"):
            cap = getattr(stats, f"kv_offload_{tier}_blocks", 0)
            if cap:
                used = getattr(stats, f"kv_offload_{tier}_used_blocks")
                hits = (getattr(stats, f"kv_offload_{tier}_hit_tokens")
                        - getattr(prev, f"kv_offload_{tier}_hit_tokens"))
                line += f", KV {tier} tier usage: {100 * used / cap:.1f}%, hits: {hits} tokens"
        logger.info(line)
        spec = self._spec_line(stats, prev, dt)
        if spec:
            logger.info(spec)
            line += "\n" + spec
        return line

    @staticmethod
    def _async_part(stats, prev) -> str:
        """", Async steps used: used/all (steady: n, launched: m)" over the interval."""
        d_used = stats.num_async_steps_used - prev.num_async_steps_used
        d_all = d_used + stats.num_async_steps_discarded - prev.num_async_steps_discarded
        part = (f", Async steps used: {d_used}/{d_all}"
                f" (steady: {stats.num_async_steps_steady - prev.num_async_steps_steady}")
        if stats.num_launched_steps:
            part += f", launched: {stats.num_launched_steps - prev.num_launched_steps}"
        return part + ")"

    @staticmethod
    def _spec_line(stats, prev, dt) -> str | None:
        """vLLM's SpecDecoding metrics line over the interval (None without new drafts)."""
        drafts = stats.spec_decode_num_drafts - prev.spec_decode_num_drafts
        if drafts <= 0:
            return None
        drafted = stats.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
        accepted = stats.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
        per_pos = [(a - b) / drafts for a, b in zip(stats.spec_decode_num_accepted_tokens_per_pos,
                                                    prev.spec_decode_num_accepted_tokens_per_pos)]
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / dt:.2f} tokens/s, "
                f"Drafted throughput: {drafted / dt:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{x:.3f}' for x in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / drafted if drafted else 0.0:.1f}%")
