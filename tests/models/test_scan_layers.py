"""Scanned layers (LlamaModel.scan_layers, `--scan-layers`): the decoder layers' weights stacked
[num_layers, ...] and run as one loop. Made from the same checkpoint, random weights or
converted folder as the unrolled layout, the engine generates what the unrolled one does;
models whose layers differ, quantized weights, tensor parallelism and the cpu attention
backend are refused in one line. (The logits against transformers: test_architectures.py's
"xla-fused-scan" cases.)"""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.engine_args import EngineArgs
from jaxkv.loader.hf import load_hf_dir
from jaxkv.models.llama import LlamaModel
from jaxkv.models.model_config import ModelConfig
from jaxkv.models.params import (dummy_params, fuse_projections, param_shapes, params_from_tensors,
                                 stack_layers)
from tests.models.test_architectures import make_hf

ENGINE = dict(max_model_len=128, max_num_batched_tokens=64, token_buckets=(8, 64),
              kv_cache_memory_bytes=1 << 20, max_num_seqs=8, attention_backend="xla")
PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 3]}, {"prompt_token_ids": list(range(20, 57))}]


def _layer(i) -> dict:
    return {"o_proj": {"kernel": jnp.full((4, 3), float(i))},
            "input_layernorm": {"weight": jnp.arange(4.0) + 10 * i}}


def test_stack_puts_each_leaf_of_every_layer_in_order():
    params = {"layers_0": _layer(0), "layers_1": _layer(1), "layers_2": _layer(2),
              "norm": {"weight": jnp.ones(4)}}
    out = stack_layers(params, 3)
    assert out is params and sorted(out) == ["layers", "norm"]  # (in place)
    k, w = out["layers"]["o_proj"]["kernel"], out["layers"]["input_layernorm"]["weight"]
    assert k.shape == (3, 4, 3) and w.shape == (3, 4)
    np.testing.assert_array_equal(k[:, 0, 0], [0, 1, 2])
    np.testing.assert_array_equal(w[2], np.arange(4.0) + 20)
    with pytest.raises(ValueError, match="scan_layers: the decoder layers' params differ"):
        stack_layers({"layers_0": _layer(0), "layers_1": {"mlp": {"router": jnp.ones(2)}}}, 2)


def test_stacking_lets_each_layers_arrays_go():
    params = {f"layers_{i}": _layer(i) for i in range(3)}
    gone = [weakref.ref(params[f"layers_{i}"]["o_proj"]["kernel"]) for i in range(3)]
    stack_layers(params, 3)
    gc.collect()
    assert [r() for r in gone] == [None] * 3


def test_random_weights_are_the_unrolled_ones_stacked(tmp_path):
    make_hf("qwen2", tmp_path)  # (q/k/v biases)
    mc = ModelConfig.from_hf_config(load_hf_dir(str(tmp_path), load_weights=False).config)
    plain = dummy_params(LlamaModel(mc), 3)
    both = dummy_params(LlamaModel(mc, fused_projections=True, scan_layers=True), 3)
    want = stack_layers(fuse_projections(plain), mc.num_layers)
    assert jax.tree.structure(want) == jax.tree.structure(both)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(both)):
        np.testing.assert_array_equal(a, b)


def _generate(folder, **engine):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    llm = LLM(model=folder, **{**ENGINE, **engine})
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def _same(got, want) -> None:
    """The same greedy tokens; sampled logprobs within float32 rounding of sums in another
    order."""
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4


def test_a_scanned_engine_generates_as_the_unrolled_one(folders):
    """From the checkpoint and from its converted folder, with the xla and the pallas
    (interpreted) attention backends, and with multi-step decode (k = 3)."""
    for folder in folders:
        _, want = _generate(folder)
        llm, got = _generate(folder, scan_layers=True)
        params = llm.llm_engine.runner.params
        assert llm.llm_engine.runner.model.scan_layers and "layers_0" not in params
        assert params["layers"]["o_proj"]["kernel"].shape[0] == 2
        _same(got, want)
    _, want = _generate(folders[0], attention_backend="pallas")
    _same(_generate(folders[0], attention_backend="pallas", scan_layers=True)[1], want)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)  # (multi-step's rows)
    want = [o.outputs[0].token_ids for o in _generate(folders[0])[0].generate(PROMPTS, plain, use_tqdm=False)]
    llm = LLM(model=folders[0], **ENGINE, scan_layers=True, num_scheduler_steps=3)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)] == want
    assert llm.stats().num_multi_steps > 0


def test_what_cannot_be_scanned_is_refused(tmp_path):
    mc = ModelConfig.from_hf_config(dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=128, sliding_window=32))
    assert "sliding windows" in mc.scan_refusal(False, False)
    moe = ModelConfig.from_hf_config(dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2))
    assert "mixture-of-experts" in moe.scan_refusal(False, False)
    make_hf("llama", tmp_path)
    dense = ModelConfig.from_hf_config(load_hf_dir(str(tmp_path), load_weights=False).config)
    assert dense.scan_refusal(False, False) is None
    assert "quantized" in dense.scan_refusal(True, False)
    assert "tensor-parallel" in dense.scan_refusal(False, True)
    for cfg, extra in ((mc, {}), (moe, {}), (dense, {"quantization": "fp8"})):
        with pytest.raises(ValueError, match="^scan_layers: "):
            EngineArgs(scan_layers=True, attention_backend="xla", **extra).create_engine_config(
                platform="cpu", model_config=cfg)
    with pytest.raises(ValueError, match="scan_layers: the cpu attention backend"):
        EngineArgs(scan_layers=True, attention_backend="cpu").create_engine_config(
            platform="cpu", model_config=dense)
    config = EngineArgs(scan_layers=True, attention_backend="xla").create_engine_config(
        platform="cpu", model_config=dense)
    assert config.runner.scan_layers


def test_one_window_on_every_layer_scans_and_mixed_windows_are_refused(tmp_path):
    """Mistral with window 7 on every layer: the scan (as a loop, and fully unrolled) runs
    layer 0's window on each, and the logits match transformers' (sliding-window attention
    included: 41 tokens > 7); Gemma2's
    windowed and global layers alternate: the model itself refuses to scan them (not only the
    engine's config)."""
    from tests.models.hf_compare import assert_logits_match
    from tests.models.test_sliding_window_models import COMMON as WCOMMON, make_windowed
    hf = make_windowed("mistral", tmp_path / "m")
    ckpt = load_hf_dir(str(tmp_path / "m"))
    mc = ModelConfig.from_hf_config(ckpt.config)
    assert mc.window(0) == 7 and mc.scan_refusal(False, False) is None
    for unroll in (1, mc.num_layers):  # a loop; the loop unrolled (static slices of the stack)
        model = LlamaModel(mc, scan_layers=True, scan_unroll=unroll)
        assert_logits_match(hf, model, params_from_tensors(model, ckpt.tensors), mc, WCOMMON["vocab_size"],
                            1e-4, f"mistral scanned, unroll {unroll}")
    make_windowed("gemma2", tmp_path / "g")
    g = ModelConfig.from_hf_config(load_hf_dir(str(tmp_path / "g"), load_weights=False).config)
    for build in (dummy_params, param_shapes):  # loading, and the model's own setup
        with pytest.raises(ValueError, match="scan_layers: .*sliding windows"):
            build(LlamaModel(g, scan_layers=True))
