"""Tensor parallelism on forced host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4,
set in a process of its own: tests/runner/tp_check.py): the same greedy tokens at TP 1, 2 and 4
and with the Pallas kernels per shard, on a random-weight model and at TP 3 on the embedded
SmolLM2 (9 query / 3 KV heads); weights and pool really split; a converted checkpoint restored
straight into its shardings; bad values fail in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import assert_same_or_near_tie

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tp_run(case: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "tests.runner.tp_check", case], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": ROOT})
    line = next((x for x in p.stdout.splitlines() if x.startswith("TP_RESULT ")), None)
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line[len("TP_RESULT "):])


def margins(run, i):
    return [sorted(d.values())[-1] - sorted(d.values())[-2] for d in run["logprobs"][i]]


def same_tokens(got, ref, what):
    for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"])):
        assert_same_or_near_tie(a, b, margins(ref, i), what=f"{what}, prompt {i}")


@pytest.fixture(scope="module")
def tiny():
    return tp_run("tiny")


def test_same_tokens_at_tp_1_2_4_and_pallas_per_shard(tiny):
    ref = tiny["xla1"]
    for name in ("xla2", "xla4", "pallas2"):
        same_tokens(tiny[name], ref, name)


def test_nothing_compiles_after_warmup(tiny):
    """The sampler programs compiled at warmup take the gathered rows as the mesh places
    them: a greedy, random and top-k workload compiles nothing at any TP (logprobs, asked by
    the token test, compile their own variant on first use, as on one device)."""
    one = tiny["xla1"]["compiled_after_warmup"]
    for name in ("xla2", "xla4"):
        assert tiny[name]["compiled_after_warmup"] == one, name


def test_weights_and_pool_are_split(tiny):
    one, two, four = tiny["xla1"], tiny["xla2"], tiny["xla4"]
    assert one["q_proj"] == "single"
    assert two["q_proj"] == "P(None, 'tp')" and two["o_proj"] == "P('tp', None)"
    assert two["embed"] == "P('tp', None)"  # by vocabulary
    assert two["pool"] == "P(None, None, None, 'tp', None)"  # by KV head
    assert four["pool"] == "P()"  # 2 KV heads on 4 devices: replicated, as vLLM
    assert len(two["param_bytes"]) == 2 and max(two["param_bytes"]) < 0.6 * one["param_bytes"][0]
    # The budget is per device (as vLLM's): a device holding half the KV heads holds twice
    # the blocks in the same bytes; each device's pool is that budget.
    assert two["num_blocks"] >= 2 * one["num_blocks"] - 2
    assert two["pool_bytes"][0] == two["pool_bytes"][1] <= 1 << 20


def test_smollm2_at_tp_3():
    r = tp_run("smollm2")
    assert r["3"]["pool"] == "P(None, None, None, 'tp', None)"
    assert len(r["3"]["param_bytes"]) == 3
    same_tokens(r["3"], r["1"], "SmolLM2 TP 3")


def test_converted_checkpoint_restores_sharded():
    r = tp_run("converted")
    assert r["tp2"]["q_proj"] == "P(None, 'tp')"
    same_tokens(r["tp2"], r["tp1"], "converted, TP 2")


def test_bad_values_fail_in_one_line():
    r = tp_run("errors")
    assert r["heads"] == "tensor_parallel_size 3 must divide num_attention_heads (4)"
    assert "tensor_parallel_size 8 needs 8 devices, found 4" in r["devices"]
    assert "pallas" in r["pallas_replicated"] and "(2)" in r["pallas_replicated"]
    for msg in r.values():
        assert "\n" not in msg


def test_quantized_weights_split_and_give_the_tp1_tokens():
    """fp8 and AWQ int4 weights at TP 2: the packed weights, scales and zero points split with
    their kernel's axis (columns for q_proj, rows for o_proj), per-channel scales with the
    columns, and the tokens are TP 1's."""
    r = tp_run("quantized")
    for name in ("fp8", "awq"):
        assert r[f"{name}2"]["quantization"] == name
        same_tokens(r[f"{name}2"], r[f"{name}1"], f"{name}, TP 2")
    # (The AWQ model's odd vocabulary keeps its embedding and LM head replicated.)
    assert max(r["fp82"]["param_bytes"]) < 0.6 * r["fp81"]["param_bytes"][0]
    fp8, awq = r["fp82"]["leaves"], r["awq2"]["leaves"]
    assert fp8 == {"q_proj.kernel": "P(None, 'tp')", "q_proj.scale": "P('tp',)",
                   "o_proj.kernel": "P('tp', None)", "o_proj.scale": "P()"}
    for leaf in ("qweight", "scales", "zeros"):
        assert awq[f"q_proj.{leaf}"] == "P(None, 'tp')" and awq[f"o_proj.{leaf}"] == "P('tp', None)"


def test_mixtures_of_experts_split_each_expert_and_give_the_tp1_tokens():
    r = tp_run("moe")
    for name in ("mixtral", "qwen2_moe"):
        same_tokens(r[f"{name}2"], r[f"{name}1"], f"{name}, TP 2")
        two = r[f"{name}2"]
        assert two["gate_proj"] == "P(None, None, 'tp')" and two["down_proj"] == "P(None, 'tp', None)"
        assert two["router"] == "P()"
        ep = r[f"{name}2ep"]  # whole experts per device
        same_tokens(ep, r[f"{name}1"], f"{name}, TP 2 with expert parallelism")
        assert ep["gate_proj"] == ep["down_proj"] == "P('tp', None, None)"


def test_quantized_experts_split_and_give_the_tp1_tokens():
    """fp8 and AWQ int4 experts at TP 2: each expert's packed weights, scales and zero points
    split with their weight's axis (gate/up by columns, down by rows), whole experts with
    expert parallelism; the tokens are TP 1's."""
    r = tp_run("moe_quantized")
    for name in ("fp8", "awq"):
        assert r[f"{name}2"]["quantization"] == r[f"{name}2ep"]["quantization"] == name
        same_tokens(r[f"{name}2"], r[f"{name}1"], f"{name} experts, TP 2")
        same_tokens(r[f"{name}2ep"], r[f"{name}1"], f"{name} experts, TP 2 with expert parallelism")
    fp8, awq = r["fp82"]["leaves"], r["awq2"]["leaves"]
    assert fp8 == {"gate_proj.kernel": "P(None, None, 'tp')", "gate_proj.scale": "P(None, 'tp')",
                   "down_proj.kernel": "P(None, 'tp', None)", "down_proj.scale": "P()"}
    for leaf in ("qweight", "scales", "zeros"):
        assert awq[f"gate_proj.{leaf}"] == "P(None, None, 'tp')"
        assert awq[f"down_proj.{leaf}"] == "P(None, 'tp', None)"
    assert set(r["awq2ep"]["leaves"].values()) == {"P('tp', None, None)"}


def test_windowed_families_give_the_tp1_tokens():
    """Sliding windows (shorter than the prompts) and Gemma's soft-capping at TP 2."""
    r = tp_run("windowed")
    for name in ("mistral", "gemma2", "gemma3"):
        same_tokens(r[f"{name}2"], r[f"{name}1"], f"{name}, TP 2")
