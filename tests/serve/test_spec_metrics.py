"""The speculative-decoding series of /metrics (vLLM's spec_decode_* counters under the jaxkv
prefix), read from EngineStats at scrape time; no server needed."""

from dataclasses import replace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.test_stat_logger import IDLE
from serve.metrics import PrometheusStatLogger


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
    assert not [k for k in scrape(IDLE) if k[0].endswith("per_pos_total")]  # off: no positions
