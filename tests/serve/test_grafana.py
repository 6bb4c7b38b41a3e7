"""deploy/grafana/jaxkv.json: valid dashboard JSON whose every query names only series that
`jaxkv serve`'s /metrics exports (read off a PrometheusStatLogger scrape, speculative decoding
on), and deploy/prometheus.yml scrapes /metrics."""

import json
import pathlib
import re
from dataclasses import replace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import PrometheusStatLogger
from tests.engine.test_stat_logger import IDLE

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


def exported_series() -> set[str]:
    from jaxkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
    stats = replace(IDLE, spec_decode_num_accepted_tokens_per_pos=(0, 0))
    lg = PrometheusStatLogger(lambda: stats, "m")
    lg.record([RequestOutput("r", None, [1, 2], None, [CompletionOutput(0, "a", [3], finish_reason="stop")],
                             True, RequestMetrics(0.0, 0.1, 0.2, 0.2, 0.3, num_generation_tokens=1))])
    text = generate_latest(lg.registry).decode()
    names = set()
    for f in text_string_to_metric_families(text):
        names |= {s.name for s in f.samples}
    return names


def test_every_panel_query_uses_exported_series():
    dash = json.loads((DEPLOY / "grafana" / "jaxkv.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(dash["panels"]) >= 12 and len(exprs) >= 20
    used = {m for e in exprs for m in re.findall(r"jaxkv:[a-z0-9_]+", e)}
    missing = used - exported_series()
    assert not missing, missing
    for needed in ("jaxkv:kv_cache_usage_perc", "jaxkv:time_to_first_token_seconds_bucket",
                   "jaxkv:spec_decode_num_accepted_tokens_total", "jaxkv:prefix_cache_hits_total"):
        assert needed in used
    for e in exprs:  # balanced parentheses and braces: a typo would not parse in Grafana
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e


def test_prometheus_example_scrapes_metrics():
    text = (DEPLOY / "prometheus.yml").read_text()
    assert "metrics_path: /metrics" in text and "127.0.0.1:8000" in text
