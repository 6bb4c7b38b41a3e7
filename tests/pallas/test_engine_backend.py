"""The engine with attention_backend="pallas" (interpret mode on this CPU), and with "xla",
gives the cpu backend's greedy outputs on the real embedded model (the session engine's
default here); backend resolution; the decode-kernel dispatch of
jaxkv.attention.pallas_attention equals the ragged path."""

import numpy as np
import pytest

from jaxkv.attention import pallas_attention
from jaxkv.engine_config import resolve_backend
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs
from tests.pallas.cases import Case, make_inputs

# Small buckets and pool: interpret mode pays ~0.25 ms per grid step, and 30 layers per step.
ENGINE = dict(max_model_len=256, max_num_batched_tokens=64, token_buckets=(4, 64),
              max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):"]


@pytest.mark.parametrize("name,platform,want", [
    ("auto", "gpu", "pallas"), ("auto", "cpu", "cpu"), ("auto", "tpu", "xla"),
    ("pallas", "cpu", "pallas"), ("pallas", "gpu", "pallas"), ("xla", "gpu", "xla"),
    ("xla", "cpu", "xla"), ("cpu", "cpu", "cpu"),
])
def test_resolve_backend(name, platform, want):
    assert resolve_backend(name, platform) == want


@pytest.mark.parametrize("backend,dtype,mesh,want", [
    ("cpu", "float32", None, True), ("xla", "float32", None, False),
    ("pallas", "float32", None, False), ("cpu", "bfloat16", None, False),
    ("cpu", "float16", None, False), ("cpu", "float32", "a mesh", False)])
def test_cpu_matmul_only_with_the_cpu_backend_float32_on_one_device(backend, dtype, mesh, want):
    from types import SimpleNamespace

    from jaxkv.engine.setup import cpu_matmul_wanted
    rc = SimpleNamespace(attention_backend=backend, dtype=dtype)
    assert cpu_matmul_wanted(rc, mesh) is want


def test_resolve_backend_rejects_unknown():
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend("triton", "gpu")


def test_xla_engine_matches_cpu_engine(llm):
    """The pure-JAX backend (the fallback without a C++ compiler) against the default one."""
    from jaxkv import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    assert llm.llm_engine.runner.model.attention.name == "cpu"  # the shared session engine
    assert llm.llm_engine.runner.model.cpu_matmul and llm.stats().cpu_matmul_max_rows == 128
    ref = llm.generate(PROMPTS, sp, use_tqdm=False)
    xla = LLM(attention_backend="xla", **ENGINE)
    assert xla.llm_engine.runner.model.attention.name == "xla"
    assert not xla.llm_engine.runner.model.cpu_matmul and xla.stats().cpu_matmul_max_rows == 0
    for a, b in zip(xla.generate(PROMPTS, sp, use_tqdm=False), ref):
        assert len(a.outputs[0].token_ids) == sp.max_tokens
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                margins_from_logprobs(b.outputs[0].logprobs), what="xla vs cpu")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_pallas_engine_matches_cpu_engine(llm, kv_cache_dtype):
    from jaxkv import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    if kv_cache_dtype == "auto":
        assert llm.llm_engine.runner.model.attention.name == "cpu"  # the shared session engine
    else:  # a quantized pool: scales read by the kernels, K/V stored rotated
        llm = LLM(kv_cache_dtype=kv_cache_dtype, **ENGINE)
    ref = llm.generate(PROMPTS, sp, use_tqdm=False)
    llm = LLM(attention_backend="pallas", kv_cache_dtype=kv_cache_dtype, **ENGINE)
    runner = llm.llm_engine.runner
    assert runner.model.attention.name == "pallas"
    seen, forward = [], runner.forward
    runner.forward = lambda step: seen.append(step.decode_only) or forward(step)
    got = llm.generate(PROMPTS, sp, use_tqdm=False)
    # Prefill steps ran the ragged kernel, the decode steps the decode kernel.
    assert seen[0] is False and seen[-1] is True and seen.count(True) >= sp.max_tokens - 1
    compiled = runner.num_compilations  # warmup + the logprobs sampler: nothing more, ever
    assert llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].token_ids == \
        got[0].outputs[0].token_ids
    assert runner.num_compilations == compiled
    for a, b in zip(got, ref):
        assert len(a.outputs[0].token_ids) == sp.max_tokens
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                margins_from_logprobs(b.outputs[0].logprobs), what="pallas vs cpu")


@pytest.mark.parametrize("stacked", [True, False])
def test_decode_only_dispatch_equals_ragged(stacked):
    case = Case("decode", "bs+1", 3, 64, 16, "float32")
    inputs = make_inputs(case, 7, stacked=stacked, pad_rows=4, pad_seqs=2)
    kw = dict(scale=64 ** -0.5, layer=inputs.layer)
    ragged = np.asarray(pallas_attention(*inputs.args, **kw))
    decode = np.asarray(pallas_attention(*inputs.args, decode_only=True, **kw))
    assert decode.shape == ragged.shape == inputs.ref.shape
    np.testing.assert_allclose(decode, ragged, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(decode, inputs.ref, rtol=1e-5, atol=1e-5)
    assert np.all(decode[inputs.num_real:] == 0)


def test_pallas_dispatch_handles_groups_wider_than_block_m():
    """128 query heads on one KV head (group 128 > the default block_m 64): the dispatch widens
    the tile, and the result equals the reference."""
    import jax.numpy as jnp

    from pallas_kernels.reference import ragged_paged_attention_reference

    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((4, 128, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 8, 1, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 8, 1, 16)), jnp.float32)
    args = (q, k, v, jnp.array([[1, 2], [3, 0]], jnp.int32), jnp.array([10, 3], jnp.int32),
            jnp.array([0, 3, 4], jnp.int32), jnp.array([2], jnp.int32))
    got = np.asarray(pallas_attention(*args, scale=0.25))
    ref = np.asarray(ragged_paged_attention_reference(*args, scale=0.25))
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 1e-5
