"""deploy/kubernetes/jaxkv.yaml: the Deployment's command line is one `jaxkv serve` accepts
(vLLM's metric names for the gateway), its probes hit /health on the served port, and the
InferencePool selects the Deployment's pods on that port."""

import pathlib

import yaml

from jaxkv.cli import build_parser

MANIFEST = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "jaxkv.yaml"


def test_manifest_matches_what_jaxkv_serve_does():
    docs = {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}
    assert set(docs) == {"Deployment", "Service", "InferencePool"}
    dep, pool = docs["Deployment"], docs["InferencePool"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["jaxkv", "serve"]
    ns = build_parser().parse_args(c["command"][1:] + c["args"])
    assert ns.metrics_prefix == "vllm" and ns.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == ns.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ns.port]
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
