"""EngineArgs validation, the KV budget arithmetic and the `jaxkv plan` command."""

import json
import subprocess
import sys

import pytest

from jaxkv.engine_args import EngineArgs
from jaxkv.core.kv_budget import parse_bytes, plan_kv_cache


@pytest.mark.parametrize("kwargs,field", [
    (dict(block_size=12), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(dtype="fp8"), "dtype"), (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(kv_cache_memory_bytes="lots"), "kv_cache_memory_bytes"), (dict(load_format="pt"), "load_format"),
    (dict(attention_backend="cuda"), "attention_backend"), (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(max_model_len=-1), "max_model_len"), (dict(token_buckets=(8, 0)), "token_buckets"),
    (dict(warmup_token_buckets=()), "warmup_token_buckets"),
    (dict(token_buckets=(8, 64), warmup_token_buckets=(16, 64)), "warmup_token_buckets"),
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
    assert json.loads(r.stdout) == {"quantization": None, "weights_bytes": 538060032,
                                    "bytes_per_token": 46080, "num_blocks": 1456, "num_tokens": 23296,
                                    "max_concurrency": 11.375}
    r = run_cli("plan", "--quantization", "gguf", "--json")  # the embedded file's blocks kept
    assert json.loads(r.stdout)["quantization"] == "gguf", r.stderr
    assert json.loads(r.stdout)["weights_bytes"] < 0.25 * 538060032
    # Tensor parallelism: the budget is per device, a device holds one of SmolLM2's 3 KV heads.
    r = run_cli("plan", "--max-model-len", "2048", "--kv-cache-memory-bytes", "1GiB", "--json",
                "--tensor-parallel-size", "3")
    assert json.loads(r.stdout)["bytes_per_token"] == 46080 // 3, r.stderr
    for bad in (["plan", "--block-size", "3"], ["plan", "--kv-cache-memory-bytes", "lots"],
                ["plan", "--max-model-len", "100000"], ["generate"], ["plan", "--dtype", "fp8"],
                ["plan", "--tensor-parallel-size", "2"]):
        r = run_cli(*bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr


def test_engine_config_is_resolved_once_per_platform_and_frozen():
    import dataclasses

    from jaxkv.engine_args import EngineArgs
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig

    mc = ModelConfig.from_hf_config(read_config(None))
    args = EngineArgs(kv_cache_memory_bytes="1GiB", max_model_len=2048)
    cpu = args.create_engine_config(platform="cpu", model_config=mc)
    gpu = args.create_engine_config(platform="gpu", model_config=mc)
    assert args.kv_cache_memory_bytes == "1GiB" and args.max_num_batched_tokens is None  # untouched
    assert (cpu.runner.dtype, gpu.runner.dtype) == ("float32", "bfloat16")
    assert (cpu.runner.attention_backend, gpu.runner.attention_backend) == ("cpu", "pallas")
    assert (cpu.scheduler.max_num_batched_tokens, gpu.scheduler.max_num_batched_tokens) == (512, 8192)
    assert cpu.runner.token_buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert cpu.runner.warmup_token_buckets == (1, 8, 64, 512)  # the rest compile in the background
    assert gpu.runner.warmup_token_buckets == (1, 8, 64, 512, 4096, 8192)
    assert gpu.cache.budget.bytes_per_token * 2 == cpu.cache.budget.bytes_per_token == 46080
    assert gpu.cache.num_blocks == 2 * cpu.cache.num_blocks  # same bytes, half the size per token
    # gpu_memory_utilization: 90% of the device minus the weights (bf16) becomes KV blocks.
    util = EngineArgs(max_model_len=2048).create_engine_config(
        platform="gpu", model_config=mc, device_memory_bytes=10 << 30)
    free = int(0.9 * (10 << 30)) - 2 * mc.num_params()
    assert util.cache.num_blocks == free // (23040 * 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu.scheduler.max_num_seqs = 3
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(max_num_seqs=1024).create_engine_config(platform="cpu", model_config=mc)


def test_token_buckets_and_which_compile_at_warmup():
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig

    mc = ModelConfig.from_hf_config(read_config(None))

    def runner(**kw):
        rc = EngineArgs(**kw).create_engine_config(platform="cpu", model_config=mc).runner
        return rc.token_buckets, rc.warmup_token_buckets

    # A budget that is no power of two ends both lists.
    assert runner(max_num_batched_tokens=100) == ((1, 2, 4, 8, 16, 32, 64, 100), (1, 8, 64, 100))
    # Explicit buckets keep their meaning: all compiled at warmup, nothing in the background.
    assert runner(max_num_batched_tokens=256, token_buckets=(256, 8, 64, 8)) == ((8, 64, 256),) * 2
    assert runner(warmup_token_buckets=(512, 4)) == (tuple(2 ** i for i in range(10)), (4, 512))
    with pytest.raises(ValueError, match=r"warmup_token_buckets .*3 is not one of token_buckets"):
        runner(warmup_token_buckets=(3, 512))
    with pytest.raises(ValueError, match=r"warmup_token_buckets \(8, 64\) must hold a bucket >= "
                                         r"max_num_batched_tokens=512"):
        runner(warmup_token_buckets=(8, 64))
    with pytest.raises(ValueError, match="token_buckets"):
        runner(max_num_batched_tokens=256, token_buckets=(8, 64))


def test_num_params_counts_the_loaded_weights(llm):
    import jax
    params = llm.llm_engine.runner.params
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == llm.llm_engine.model_config.num_params()


def test_every_engine_argument_is_a_flag_of_every_command():
    import argparse
    import dataclasses

    from jaxkv.cli import build_parser
    from jaxkv.engine_args import _arg

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in ("generate", "plan", "serve"):
        dests = {a.dest for a in sub.choices[name]._actions}
        assert fields <= dests, (name, fields - dests)
    # A field declared once becomes a flag, with its default and help, without other changes.
    NewArgs = dataclasses.make_dataclass(
        "NewArgs", [("new_knob", int, _arg(3, "a knob added later"))], bases=(EngineArgs,))
    p = NewArgs.add_cli_args(argparse.ArgumentParser())
    assert "a knob added later" in p.format_help()
    ns = p.parse_args(["--new-knob", "5", "--no-enable-prefix-caching"])
    args = NewArgs.from_cli_args(ns)
    assert args.new_knob == 5 and args.enable_prefix_caching is False
