"""kv_cache_dtype (vLLM's --kv-cache-dtype): the pool stores K/V narrower than the weights.
The write rounds to the pool's dtype (saturating for float8), both attention paths read it
(XLA and the Pallas kernels, interpret mode here) as the oracle does, the plan's capacity
doubles (bfloat16) or quadruples (fp8), and on ten chat prompts the greedy tokens of a bfloat16
pool stay those of a float32 pool for 16 tokens on at least 9 of them (unscaled fp8, with 3
mantissa bits, keeps the first token on 8 of 10; its numbers are in the README)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.attention import pallas_attention, write_kv
from jaxkv.attention.xla_ragged import xla_ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.conftest import TEST_ENGINE
from tests.engine.test_hf_parity import PROMPTS

DTYPES = {"bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
MORE = ["Give two tips for a job interview.", "What is 12 times 12?",
        "Describe the color blue to someone who cannot see.", "Why do cats purr?"]


@pytest.mark.parametrize("name", list(DTYPES))
def test_write_rounds_and_both_paths_read_like_the_oracle(name):
    dt = DTYPES[name]
    rng = np.random.default_rng(0)
    L, nb, bs, nk, d, nq = 2, 12, 4, 2, 16, 4
    kc = jnp.zeros((L, nb, bs, nk, d), dt)
    vc = jnp.zeros((L, nb, bs, nk, d), dt)
    k = jnp.asarray(rng.standard_normal((10, nk, d)) * 3, jnp.float32).at[0, 0, 0].set(1e6)
    v = jnp.asarray(rng.standard_normal((10, nk, d)), jnp.float32)
    slots = jnp.arange(4, 14, dtype=jnp.int32)  # blocks 1-3
    kc, vc = write_kv(kc, vc, k, v, slots, 1)
    got = np.asarray(kc[1, 1:4].reshape(12, nk, d)[:10].astype(jnp.float32))
    want = np.array(k.astype(dt).astype(jnp.float32))
    big = float(jnp.finfo(dt).max)
    want[0, 0, 0] = float(jnp.asarray(min(1e6, big), jnp.float32).astype(dt).astype(jnp.float32))  # saturated, never NaN
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)
    rel = np.abs(got[1:] - np.asarray(k[1:])) / (np.abs(np.asarray(k[1:])) + 1e-3)
    assert np.median(rel) < {"bfloat16": 4e-3}.get(name, 0.07)
    # Attention over that pool: 2 sequences (a decode of context 7 and a 3-token chunk).
    q = jnp.asarray(rng.standard_normal((4, nq, d)), jnp.float32)
    tables = jnp.asarray([[1, 2, 0], [2, 3, 0]], jnp.int32)
    lens, qsl, n = jnp.asarray([7, 8], jnp.int32), jnp.asarray([0, 1, 4], jnp.int32), jnp.asarray([2], jnp.int32)
    kc1, vc1 = kc[1], vc[1]
    ref = ragged_paged_attention_reference(q, kc1, vc1, tables, lens, qsl, n, scale=0.25)
    xla = xla_ragged_paged_attention(q, kc, vc, tables, lens, qsl, n, scale=0.25, layer=1)
    pal = pallas_attention(q, kc, vc, tables, lens, qsl, n, scale=0.25, layer=jnp.int32(1))
    np.testing.assert_allclose(np.asarray(xla), np.asarray(ref), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(pal), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_plan_capacity():
    from jaxkv.config import EngineArgs
    from jaxkv.engine_config import create_engine_config
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.loader.source import read_config

    mc = ModelConfig.from_hf_config(read_config(None))
    tokens = {}
    for kv in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        c = create_engine_config(EngineArgs(kv_cache_dtype=kv, kv_cache_memory_bytes="256MiB",
                                            max_model_len=2048), platform="cpu", model_config=mc)
        tokens[kv] = (c.cache.budget.bytes_per_token, c.runner.kv_cache_dtype)
    assert tokens["auto"] == (46080, "float32")
    assert tokens["bfloat16"] == (23040, "bfloat16")
    assert tokens["fp8"] == tokens["fp8_e4m3"] == (11520, "float8_e4m3fn")
    assert tokens["fp8_e5m2"] == (11520, "float8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4")


@pytest.fixture(scope="module")
def reference(llm):
    convs = [[{"role": "user", "content": p}] for p in PROMPTS + MORE]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=20)
    return convs, sp, llm.chat(convs, sp, use_tqdm=False)


@pytest.mark.parametrize("name", ["bfloat16", "fp8"])
def test_greedy_tokens_stay_those_of_float32(name, reference):
    convs, sp, ref = reference
    llm = LLM(kv_cache_dtype=name, **TEST_ENGINE)
    assert llm.llm_engine.runner.kv_cache[0].dtype == DTYPES[name]
    got = llm.chat(convs, sp, use_tqdm=False)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, ref))
    diffs = [abs(a.outputs[0].logprobs[0][t].logprob - lp.logprob)
             for a, b in zip(got, ref) for t, lp in b.outputs[0].logprobs[0].items()
             if t in a.outputs[0].logprobs[0]]
    first = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(got, ref))
    print(f"\n{name}: {same}/10 greedy 16-token outputs equal float32's ({first}/10 first "
          f"tokens); mean |first-token "
          f"logprob difference| {np.mean(diffs):.4f} over {len(diffs)} top-20 entries")
    if name == "bfloat16":  # the bar
        assert same >= 9 and np.mean(diffs) < 0.02
    else:  # unscaled float8 (3 mantissa bits): measured, below that bar (README)
        assert first >= 8 and np.mean(diffs) < 0.25
    s = llm.stats()
    assert s.num_total_blocks > 1.9 * reference_blocks() * (2 if name == "fp8" else 1)


def reference_blocks() -> int:
    return (128 << 20) // (16 * 46080) - 1
