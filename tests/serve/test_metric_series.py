"""Series of /metrics checked without a server: the speculative-decoding counters (vLLM's
spec_decode_* under the jaxkv prefix, read from EngineStats at scrape time), the per-request
token and time-per-output-token histograms (vLLM's names and bucket edges), and
--metrics-prefix with the cache_config_info gauge (what a Kubernetes inference gateway reads)."""

from dataclasses import replace

import pytest

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.test_stat_logger import IDLE
from serve.metrics import PrometheusStatLogger, cache_config_info, check_metrics_prefix


def scrape(stats) -> dict:
    text = generate_latest(PrometheusStatLogger(lambda: stats, "m").registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_spec_decode_counters_and_per_position():
    stats = replace(IDLE, spec_decode_num_drafts=20, spec_decode_num_draft_tokens=60,
                    spec_decode_num_accepted_tokens=30, spec_decode_num_accepted_tokens_per_pos=(15, 10, 5))
    m = scrape(stats)
    lab = (("model_name", "m"),)
    assert m[("jaxkv:spec_decode_num_drafts_total", lab)] == 20
    assert m[("jaxkv:spec_decode_num_draft_tokens_total", lab)] == 60
    assert m[("jaxkv:spec_decode_num_accepted_tokens_total", lab)] == 30
    per_pos = {dict(k[1])["position"]: v for k, v in m.items()
               if k[0] == "jaxkv:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 15, "1": 10, "2": 5}
    assert not [k for k in scrape(IDLE) if "spec_decode" in k[0]]  # off: no spec series


def test_fused_sampling_steps_counter():
    lab = (("model_name", "m"),)
    assert scrape(replace(IDLE, num_fused_sampling_steps=7))[("jaxkv:fused_sampling_steps_total", lab)] == 7


def test_request_token_and_tpot_histograms():
    """Per sample, as vLLM observes per request: n = 2 whose samples finish in different
    (DELTA) outputs, one of a single token."""
    from jaxkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from serve.metrics import build_1_2_5_buckets

    assert build_1_2_5_buckets(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    lg = PrometheusStatLogger(lambda: IDLE, "m", max_model_len=1024)
    first = RequestOutput("r", None, [5] * 30, None, [CompletionOutput(0, "a", [1] * 11, finish_reason="length")],
                          False, RequestMetrics(0.0, 0.1, 0.5, 1.5, None, num_generation_tokens=14,
                                                finished_samples=[(0, 11, 0.5, 1.5)]))
    last = RequestOutput("r", None, [5] * 30, None, [CompletionOutput(1, "b", [1], finish_reason="stop")],
                         True, RequestMetrics(0.0, 0.1, 0.5, 1.6, 1.6, num_generation_tokens=12,
                                              finished_samples=[(1, 1, 0.6, 0.6)]))
    lg.record([first])
    lg.record([last])
    text = generate_latest(lg.registry).decode()
    m = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert m[("jaxkv:request_prompt_tokens_sum", None)] == 60 and m[("jaxkv:request_prompt_tokens_count", None)] == 2
    assert m[("jaxkv:request_prompt_tokens_bucket", "20.0")] == 0
    assert m[("jaxkv:request_prompt_tokens_bucket", "50.0")] == 2
    assert m[("jaxkv:request_generation_tokens_sum", None)] == 12
    assert m[("jaxkv:request_generation_tokens_bucket", "1.0")] == 1
    assert m[("jaxkv:request_time_per_output_token_seconds_sum", None)] == pytest.approx(0.1)  # 1 s / 10, and 0
    assert m[("jaxkv:request_time_per_output_token_seconds_count", None)] == 2


def test_metrics_prefix_renames_every_series_and_cache_config_info():
    from jaxkv.engine_args import EngineArgs

    def names(prefix):
        lg = PrometheusStatLogger(lambda: IDLE, "m", prefix=prefix,
                                  cache_info=cache_config_info(EngineArgs(block_size=32)))
        text = generate_latest(lg.registry).decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    ours, theirs = names("jaxkv"), names("vllm")
    assert ours and all(n.startswith("jaxkv:") for n in ours)
    assert {n.replace("jaxkv:", "vllm:", 1) for n in ours} == set(theirs)
    # What the gateway routes by (gateway-api-inference-extension's vLLM defaults):
    for n in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
              "cache_config_info"):
        assert f"vllm:{n}" in theirs, n
    (info,) = theirs["vllm:cache_config_info"].samples
    assert info.value == 1.0
    assert info.labels["block_size"] == "32" and info.labels["cache_dtype"] == "auto"
    assert info.labels["num_gpu_blocks"] == str(IDLE.num_total_blocks)
    (par,) = names("jaxkv")["jaxkv:parallel_config_info"].samples
    assert par.labels == {"tensor_parallel_size": str(IDLE.tensor_parallel_size),
                          "num_processes": str(IDLE.num_processes)}
    (att,) = names("jaxkv")["jaxkv:attention_backend_info"].samples
    assert att.labels == {"attention_backend": "cpu", "cpu_matmul_max_rows": "8"}
    assert att.value == 1.0
    for bad in ("", "1x", "vllm:", "a-b", None):
        with pytest.raises(ValueError, match="--metrics-prefix"):
            check_metrics_prefix(bad)


def test_kv_offload_series_per_tier():
    stats = replace(IDLE, kv_offload_host_blocks=100, kv_offload_host_used_blocks=25,
                    kv_offload_host_hit_tokens=480, kv_offload_host_stored_blocks=40,
                    kv_offload_host_loaded_blocks=30, kv_offload_disk_blocks=1000,
                    kv_offload_disk_used_blocks=500, kv_offload_disk_hit_tokens=160,
                    kv_offload_disk_stored_blocks=40, kv_offload_disk_loaded_blocks=10,
                    num_swapped_out=3)
    m = scrape(stats)
    host, disk = (("model_name", "m"), ("tier", "host")), (("model_name", "m"), ("tier", "disk"))
    assert m[("jaxkv:kv_offload_usage_perc", host)] == 0.25
    assert m[("jaxkv:kv_offload_usage_perc", disk)] == 0.5
    assert m[("jaxkv:kv_offload_hit_tokens_total", host)] == 480
    assert m[("jaxkv:kv_offload_stored_blocks_total", disk)] == 40
    assert m[("jaxkv:kv_offload_loaded_blocks_total", host)] == 30
    assert m[("jaxkv:num_swapped_out_total", (("model_name", "m"),))] == 3
    assert not [k for k in scrape(IDLE) if "kv_offload" in k[0]]  # off: no series


def test_async_steps_counter_by_outcome():
    m = scrape(replace(IDLE, async_scheduling=True, num_async_steps=9, num_async_steps_used=7,
                       num_async_steps_discarded=1))
    got = {dict(k[1])["outcome"]: v for k, v in m.items() if k[0] == "jaxkv:async_steps_total"}
    assert got == {"used": 7, "discarded": 1}
    assert not [k for k in scrape(IDLE) if "async_steps" in k[0]]  # off: no series


def test_every_series_is_in_the_serving_docs_table():
    """docs/serving.md lists every series a scrape can show (every feature's on here)."""
    import pathlib
    import re
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    listed = set(re.findall(r"`([a-z0-9_]+)`", doc))
    stats = replace(IDLE, async_scheduling=True, kv_offload_host_blocks=10, kv_offload_disk_blocks=10,
                    spec_decode_num_accepted_tokens_per_pos=(1,))
    text = generate_latest(PrometheusStatLogger(lambda: stats, "m", cache_info={"block_size": 16})
                           .registry).decode()
    names = {f.name.removeprefix("jaxkv:") + ("_total" if f.type == "counter" else "")
             for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
    assert len(names) > 30
    assert names - listed == set()
