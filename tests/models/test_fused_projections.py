"""Fused projections (LlamaModel.fused_projections, the GPU's layout): q/k/v and gate/up as one
weight each, made from the same checkpoint, random weights or converted folder as the unfused
layout; the engine picks it on a GPU only (here it is forced) and then generates what the
unfused engine generates."""

import gc
import weakref
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.engine import setup
from jaxkv.loader.hf import load_hf_dir
from jaxkv.models.llama import LlamaModel
from jaxkv.models.model_config import ModelConfig
from jaxkv.models.params import dummy_params, fuse_projections, split_projections
from tests.models.test_architectures import make_hf

ENGINE = dict(max_model_len=128, max_num_batched_tokens=64, token_buckets=(8, 64),
              kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 3]}, {"prompt_token_ids": list(range(20, 57))}]


def _k(*shape):
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


def _layer() -> dict:
    return {"q_proj": {"kernel": _k(4, 8), "bias": jnp.ones(8)}, "k_proj": {"kernel": _k(4, 2), "bias": jnp.zeros(2)},
            "v_proj": {"kernel": -_k(4, 2), "bias": 2 * jnp.ones(2)}, "gate_proj": {"kernel": _k(4, 6)},
            "up_proj": {"kernel": 7 + _k(4, 6)}, "o_proj": {"kernel": _k(8, 4)}}


def test_fuse_concatenates_each_layers_outputs_in_order():
    moe = {"mlp": {"router": _k(4, 3)}, **{m: _layer()[m] for m in ("q_proj", "k_proj", "v_proj")}}
    params = {"layers_0": _layer(), "layers_1": moe, "norm": {"weight": jnp.ones(4)}}
    out = fuse_projections(params)
    l0 = out["layers_0"]
    assert out is params  # (in place)
    assert sorted(l0) == ["gate_up_proj", "o_proj", "qkv_proj"] and sorted(out["layers_1"]) == ["mlp", "qkv_proj"]
    np.testing.assert_array_equal(l0["qkv_proj"]["kernel"], np.concatenate([_k(4, 8), _k(4, 2), -_k(4, 2)], 1))
    np.testing.assert_array_equal(l0["qkv_proj"]["bias"], [1] * 8 + [0, 0, 2, 2])
    np.testing.assert_array_equal(l0["gate_up_proj"]["kernel"], np.concatenate([_k(4, 6), 7 + _k(4, 6)], 1))
    with pytest.raises(ValueError, match="layers_0/q_proj: only float weights"):
        fuse_projections({"layers_0": {**_layer(), "q_proj": {"qweight": _k(4, 8)}}})


def test_fusing_lets_each_layers_unfused_arrays_go():
    """Loading holds one layer's projections twice at most, not the whole model's."""
    params = {"layers_0": _layer(), "layers_1": _layer()}
    gone = [weakref.ref(params[f"layers_{i}"][m]["kernel"]) for i in (0, 1)
            for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
    fuse_projections(params)
    gc.collect()
    assert [r() for r in gone] == [None] * len(gone)


def test_split_gives_the_projections_back():
    c = NS(num_heads=2, head_dim=4, num_kv_heads=1, intermediate_size=6)  # q 8, k/v 4
    layer = {**_layer(), "k_proj": {"kernel": _k(4, 4), "bias": jnp.zeros(4)},
             "v_proj": {"kernel": -_k(4, 4), "bias": 2 * jnp.ones(4)}}
    want = {m: {leaf: np.asarray(a) for leaf, a in v.items()} for m, v in layer.items()}
    got = split_projections(fuse_projections({"layers_0": layer})["layers_0"], c)
    assert sorted(got) == sorted(want)
    for m in want:
        for leaf in want[m]:
            np.testing.assert_array_equal(got[m][leaf], want[m][leaf])


def test_random_weights_are_the_unfused_ones_fused(tmp_path):
    make_hf("qwen2", tmp_path)  # (q/k/v biases)
    mc = ModelConfig.from_hf_config(load_hf_dir(str(tmp_path), load_weights=False).config)
    plain, fused = dummy_params(LlamaModel(mc), 3), dummy_params(LlamaModel(mc, fused_projections=True), 3)
    plain = fuse_projections(plain)
    assert jax.tree.structure(plain) == jax.tree.structure(fused)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(fused)):
        np.testing.assert_array_equal(a, b)


def _generate(folder):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in LLM(model=folder, **ENGINE).generate(PROMPTS, sp, use_tqdm=False)]


def test_an_engine_forced_to_fuse_generates_as_the_unfused_one(folders, monkeypatch):
    """From the checkpoint and from its converted folder: the same greedy tokens, and sampled
    logprobs within float32 rounding of a matmul's sums in another order."""
    want = {f: _generate(f) for f in folders}
    monkeypatch.setattr(setup, "fused_projections_wanted", lambda rc, mesh: True)
    for folder in folders:
        llm = LLM(model=folder, **ENGINE)
        assert llm.llm_engine.runner.model.fused_projections
        assert "qkv_proj" in llm.llm_engine.runner.params["layers_1"]
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
        got = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        for g, w in zip(got, want[folder]):
            assert g.token_ids == w.token_ids
            for a, b in zip(g.logprobs, w.logprobs):
                assert a.keys() == b.keys()
                assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4


def test_the_engine_fuses_on_a_gpu_only():
    on_gpu = jax.default_backend() == "gpu"
    assert setup.fused_projections_wanted(NS(quantization=None), None) == on_gpu
    assert not setup.fused_projections_wanted(NS(quantization=object()), None)
    assert not setup.fused_projections_wanted(NS(quantization=None), object())
