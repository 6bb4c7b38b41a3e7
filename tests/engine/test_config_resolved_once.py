"""The engine build uses the EngineConfig that `create_engine_config` resolves, as it is: for
every kind of engine built here (the backends, the fallback without the C++ kernel, quantized
pools with the KV tiers, speculative decoding, async scheduling off), the engine's, runner's and
scheduler's config equal a fresh `create_engine_config` of the same arguments on this machine.
(The tensor-parallel and multi-process engines are built in processes of their own by
tests/runner/tp_check.py and multiprocess_check.py; their resolution goes through the same
`build_engine` lines.)"""

import jax
import pytest

from jaxkv.cpu_kernels import build
from jaxkv.engine import LLMEngine
from jaxkv.engine_args import EngineArgs
from jaxkv.loader.source import load_checkpoint
from jaxkv.models.model_config import ModelConfig
from tests.helpers import write_tiny_model

TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
BASE = dict(load_format="dummy", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
            kv_cache_memory_bytes=1 << 20, enforce_eager=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A config.json and tokenizer files: a 2-layer Llama for load_format="dummy"."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), TINY_CONFIG)


KINDS = {
    "cpu": {},
    "xla": dict(attention_backend="xla"),
    "pallas": dict(attention_backend="pallas"),
    "int8 pool, host and disk tiers": dict(kv_cache_dtype="int8", swap_space=0.01),
    "speculative": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    "async scheduling off": dict(async_scheduling=False, enable_prefix_caching=False),
}


def resolved(args: EngineArgs):
    return args.create_engine_config(
        platform=jax.default_backend(),
        model_config=ModelConfig.from_hf_config(load_checkpoint(args.model, args.load_format).config),
        device_memory_bytes=None, num_processes=1, cpu_kernels_unavailable=build.unavailable)


def built_config(args: EngineArgs):
    engine = LLMEngine.from_engine_args(args)
    try:
        assert engine.runner.config is engine.config
        assert engine.scheduler.config == engine.config.scheduler
        return engine.config
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_build_uses_the_resolved_config(tiny_model, tmp_path, kind):
    kw = dict(KINDS[kind])
    if "swap_space" in kw:
        kw.update(kv_cache_disk_dir=str(tmp_path / "kv"), kv_cache_disk_bytes=1 << 20)
    args = EngineArgs(model=tiny_model, **BASE, **kw)
    assert built_config(args) == resolved(args)


def test_the_fallback_without_the_cpu_kernel_is_resolved_too(tiny_model, monkeypatch):
    monkeypatch.setattr(build, "load", lambda: None)
    monkeypatch.setattr(build, "_error", "no C++ compiler found")
    args = EngineArgs(model=tiny_model, **BASE)
    config = built_config(args)
    assert config.runner.attention_backend == "xla"
    assert config == resolved(args)
