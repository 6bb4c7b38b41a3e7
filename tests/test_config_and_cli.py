"""EngineArgs validation, the KV budget arithmetic and the `jaxkv plan` command."""

import json
import subprocess
import sys

import pytest

from jaxkv.config import EngineArgs
from jaxkv.core.kv_budget import parse_bytes, plan_kv_cache


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=12), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(dtype="fp8"), "dtype"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(kv_cache_memory_bytes="lots"), "kv_cache_memory_bytes"), (dict(load_format="pt"), "load_format"),
    (dict(attention_backend="cuda"), "attention_backend"), (dict(tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(max_model_len=-1), "max_model_len"),
])
def test_engine_args_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)


def test_kv_budget_for_smollm2_fp32():
    b = plan_kv_cache(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, block_size=16,
                      max_model_len=2048)
    assert (b.bytes_per_token, b.num_blocks, b.num_tokens) == (46080, 1456, 23296)
    assert b.max_concurrency == pytest.approx(23296 / 2048)
    o = plan_kv_cache(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4, block_size=16,
                      max_model_len=2048, num_gpu_blocks_override=100, kv_cache_memory_bytes=1 << 30)
    assert o.num_blocks == 100  # the override wins
    g = plan_kv_cache(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2, block_size=16,
                      max_model_len=2048, device_memory_bytes=10 << 30, gpu_memory_utilization=0.5,
                      used_memory_bytes=1 << 30)
    assert g.num_blocks == (4 << 30) // (23040 * 16)
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GB") == 2 * 10**9


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxkv.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_json_and_one_line_errors():
    r = run_cli("plan", "--max-model-len", "2048", "--kv-cache-memory-bytes", "1GiB", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"bytes_per_token": 46080, "num_blocks": 1456, "num_tokens": 23296,
                                    "max_concurrency": 11.375}
    for bad in (["plan", "--block-size", "3"], ["plan", "--kv-cache-memory-bytes", "lots"],
                ["plan", "--max-model-len", "100000"], ["generate"], ["plan", "--dtype", "fp8"]):
        r = run_cli(*bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr
