"""The periodic throughput log line (vLLM's LoggingStatLogger shape)."""

from __future__ import annotations

from dataclasses import replace

from jaxkv.engine.stat_logger import LoggingStatLogger
from jaxkv.engine.stats import EngineStats

IDLE = EngineStats(num_total_blocks=100, num_free_blocks=100, kv_cache_usage=0.0,
                   prefix_cache_queries=0, prefix_cache_hits=0, num_prompt_tokens=0,
                   num_computed_prompt_tokens=0, num_generation_tokens=0, num_preemptions=0,
                   num_compilations=0, num_running=0, num_waiting=0, attention_backend="cpu",
                   cpu_matmul_max_rows=8,
                   token_buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                   compiled_token_buckets=(1, 8, 64, 512))


def test_rates_over_the_interval_and_silence_when_idle():
    now = [0.0]
    lg = LoggingStatLogger(5.0, clock=lambda: now[0])
    assert lg.maybe_log(IDLE) is None          # baseline
    now[0] = 2.0
    busy = replace(IDLE, num_computed_prompt_tokens=1000, num_generation_tokens=50, num_running=3,
                   num_waiting=2, num_free_blocks=75, kv_cache_usage=0.25,
                   prefix_cache_queries=400, prefix_cache_hits=100, num_preemptions=1)
    assert lg.maybe_log(busy) is None          # interval not over yet
    now[0] = 5.0
    line = lg.maybe_log(busy)
    assert line == ("Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, Preemptions: 1, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%, Compiled token buckets: 4/10")
    now[0] = 10.0
    done = replace(busy, num_running=0, num_waiting=0, num_generation_tokens=100,
                   prefix_cache_queries=500, prefix_cache_hits=200,
                   compiled_token_buckets=busy.token_buckets)  # the background compile is done
    line = lg.maybe_log(done)                  # the burst's last line: 50 tokens in 5 s
    assert "Avg generation throughput: 10.0 tokens/s" in line and "Running: 0 reqs" in line
    assert "Prefix cache hit rate: 100.0%" in line  # 100 hits of 100 queries in this interval
    assert line.endswith(", Compiled token buckets: 10/10")
    now[0] = 20.0
    assert lg.maybe_log(done) is None          # nothing happened: no line


def test_spec_decoding_line_over_the_interval():
    now = [0.0]
    lg = LoggingStatLogger(5.0, clock=lambda: now[0])
    base = replace(IDLE, spec_decode_num_accepted_tokens_per_pos=(0, 0, 0))
    lg.maybe_log(base)
    now[0] = 10.0
    busy = replace(base, num_running=1, num_generation_tokens=90, spec_decode_num_drafts=20,
                   spec_decode_num_draft_tokens=60, spec_decode_num_accepted_tokens=30,
                   spec_decode_num_accepted_tokens_per_pos=(15, 10, 5))
    line = lg.maybe_log(busy).split("\n")[1]
    assert line == ("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 "
                    "tokens/s, Drafted throughput: 6.00 tokens/s, Accepted: 30 tokens, Drafted: 60 "
                    "tokens, Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft "
                    "acceptance rate: 50.0%")
    now[0] = 20.0
    assert "\n" not in lg.maybe_log(replace(busy, num_generation_tokens=100))  # no new drafts


def test_structured_output_requests_appear_once_any_came():
    now = [0.0]
    lg = LoggingStatLogger(5.0, clock=lambda: now[0])
    lg.maybe_log(IDLE)
    now[0] = 5.0
    busy = replace(IDLE, num_running=1, num_generation_tokens=10)
    assert "Structured" not in lg.maybe_log(busy)
    now[0] = 10.0
    line = lg.maybe_log(replace(busy, num_structured_output_requests=3))
    assert line.endswith(", Structured output requests: 3")
    now[0] = 15.0
    assert lg.maybe_log(replace(busy, num_structured_output_requests=3)).endswith(
        "Structured output requests: 0")


def test_kv_tiers_usage_and_hits_when_on():
    now = [0.0]
    lg = LoggingStatLogger(5.0, clock=lambda: now[0])
    base = replace(IDLE, kv_offload_host_blocks=200, kv_offload_disk_blocks=1000)
    lg.maybe_log(base)
    now[0] = 5.0
    busy = replace(base, num_running=1, num_generation_tokens=10, kv_offload_host_used_blocks=50,
                   kv_offload_host_hit_tokens=320, kv_offload_disk_used_blocks=100,
                   kv_offload_disk_hit_tokens=64)
    line = lg.maybe_log(busy)
    assert line.endswith(", KV host tier usage: 25.0%, hits: 320 tokens, "
                         "KV disk tier usage: 10.0%, hits: 64 tokens")
    lg2 = LoggingStatLogger(5.0, clock=lambda: now[0])
    lg2.maybe_log(IDLE)
    now[0] = 15.0
    assert "tier" not in lg2.maybe_log(replace(IDLE, num_running=1, num_generation_tokens=5))


def test_async_steps_used_over_the_interval_when_on():
    now = [0.0]
    lg = LoggingStatLogger(5.0, clock=lambda: now[0])
    base = replace(IDLE, async_scheduling=True, num_async_steps_used=10, num_async_steps_discarded=2)
    lg.maybe_log(base)
    now[0] = 5.0
    line = lg.maybe_log(replace(base, num_running=1, num_generation_tokens=40,
                                num_async_steps_used=47, num_async_steps_discarded=3,
                                num_async_steps_steady=30, num_launched_steps=38))
    assert line.endswith(", Async steps used: 37/38 (steady: 30, launched: 38)")
    lg2 = LoggingStatLogger(5.0, clock=lambda: now[0])
    lg2.maybe_log(IDLE)
    now[0] = 15.0
    assert "Async" not in lg2.maybe_log(replace(IDLE, num_running=1, num_generation_tokens=5))
