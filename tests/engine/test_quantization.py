"""quantization= / --quantization on the engine: fp8 weights on the embedded model against
float32 (ten chat prompts, as the KV-dtype table measures), the W8A8 matmul (per-token
activation scales: a row's result does not depend on its neighbours), the weights' bytes in
stats, and bad input failing in one line naming the field or tensor."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import LLM
from jaxkv.engine_args import EngineArgs
from jaxkv.quantization import QuantSpec, resolve
from jaxkv.quantization import linear as qlinear
from jaxkv.quantization.load import linear_leaves, quantize_fp8, quantize_int4
from tests.conftest import TEST_ENGINE
from tests.engine.test_kv_cache_dtype import (_divergences, first_token_diffs,  # noqa: F401
                                              reference)


def test_fp8_weights_on_the_embedded_model(reference):  # noqa: F811
    convs, sp, ref = reference
    llm = LLM(quantization="fp8", **TEST_ENGINE)
    got = llm.chat(convs, sp, use_tqdm=False)
    margins = _divergences(got, ref)
    diffs = first_token_diffs(got, ref)
    first = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(got, ref))
    s = llm.stats()
    print(f"\nfp8 weights (quantized at load, widened in the matmul on the CPU): "
          f"{10 - len(margins)}/10 greedy 16-token outputs equal float32's ({first}/10 first "
          f"tokens; float32 margins where they part: {[round(m, 3) for m in margins]}); mean "
          f"|first-token logprob difference| {np.mean(diffs):.4f} over {len(diffs)} top-20 "
          f"entries; weights {s.weights_bytes / 2**20:.1f} MiB")
    assert first >= 6 and np.mean(diffs) <= 0.25
    assert s.quantization == "fp8"
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.quantization import weights_bytes
    spec = llm.llm_engine.config.runner.quantization  # what jaxkv plan counts is what is held
    assert weights_bytes(ModelConfig.from_hf_config(read_config(None)), 4, spec) == s.weights_bytes
    float_bytes = 134_515_008 * 4  # SmolLM2-135M's parameters in float32
    # The layers at one byte a weight; the tied embedding (28.3 M) stays float32.
    assert 0.35 * float_bytes < s.weights_bytes < 0.42 * float_bytes


def test_w8a8_rows_are_scaled_apart():
    """W8A8 (the GPU's fp8 path, run here on the CPU): within a few percent of the float
    product, and each row's result is the same whatever rows share its step."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    leaves = {k: jnp.asarray(v) for k, v in quantize_fp8(w).items()}
    spec = QuantSpec("fp8", fp8_activations=True)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[4] *= 1000  # a loud neighbour
    y = np.asarray(qlinear.apply(jnp.asarray(x), leaves, spec, jnp.float32))
    ref = x @ np.asarray(qlinear.dequantize(leaves, spec, jnp.float32))
    assert (np.abs(y - ref).max(axis=1) / np.abs(ref).max(axis=1)).max() < 0.08
    alone = np.asarray(qlinear.apply(jnp.asarray(x[:1]), leaves, spec, jnp.float32))
    np.testing.assert_allclose(alone[0], y[0], rtol=1e-5)  # the dot's summation order aside


def test_int4_leaves_round_trip():
    """Round-to-nearest int4 with zero points: every weight within half a step of its group."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    spec = QuantSpec("awq", bits=4, group_size=32)
    leaves = quantize_int4(w, spec)
    deq = np.asarray(qlinear.dequantize({k: jnp.asarray(v) for k, v in leaves.items()}, spec, jnp.float32))
    step = np.repeat(leaves["scales"].astype(np.float32), 32, axis=0)
    assert np.all(np.abs(deq - w) <= 0.5 * step + 1e-3)


def test_plan_and_bytes():
    """The KV budget counts the quantized weights' bytes (what the pool may use on a GPU)."""
    from jaxkv.quantization import weights_bytes
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig
    mc = ModelConfig.from_hf_config(read_config(None))
    fp8 = weights_bytes(mc, 4, QuantSpec("fp8"))
    layers = mc.num_params() - mc.vocab_size * mc.hidden_size - mc.hidden_size * (2 * mc.num_layers + 1)
    scales = 4 * mc.num_layers * (576 + 192 + 192 + 576 + 1536 + 1536 + 576)  # q k v o gate up down
    assert fp8 == mc.num_params() * 4 - 3 * layers + scales  # 1 byte a weight, float32 scales
    config = EngineArgs(quantization="fp8").create_engine_config(platform="cpu")
    assert config.runner.quantization == QuantSpec("fp8", online=True)
    assert EngineArgs(quantization="fp8").create_engine_config(
        platform="gpu").runner.quantization.fp8_activations


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
W4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True}


def ct(*weights, fmt="pack-quantized", **group):
    """A compressed-tensors quantization_config with one config group per weights dict."""
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {f"g{i}": {"targets": ["Linear"], "weights": w, **group}
                              for i, w in enumerate(weights)}}


def getter(tensors: dict):
    """A checkpoint's `get`: the tensor, or ValueError naming a missing one (as the loaders')."""
    def get(name):
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return tensors[name]
    return get


@pytest.mark.parametrize("asked,qc,match", [
    ("awq", None, "quantization='awq' needs a checkpoint"),
    ("gptq", AWQ, "does not match the checkpoint's quantization_config.quant_method 'awq'"),
    (None, {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    (None, {**AWQ, "bits": 8}, "quantization_config.bits"),
    (None, {**AWQ, "version": "gemv"}, "quantization_config.version"),
    (None, {"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
    (None, {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}}, "config_groups.g.weights"),
    (None, ct(W4, input_activations={"type": "int", "num_bits": 8}), "g0.input_activations"),
    (None, ct({**W4, "num_bits": 8}), "config_groups.g0.weights: jaxkv reads"),
    (None, ct(W4, {**W4, "group_size": 64}), "one weight scheme for every layer"),
    (None, ct(W4, fmt="float-quantized"), "format 'float-quantized' is not supported for int4"),
    (None, ct({**W4, "group_size": 0}), "g0.weights.group_size must be a positive integer"),
])
def test_bad_quantization_fails_in_one_line(asked, qc, match):
    with pytest.raises(ValueError, match=match) as e:
        resolve(asked, {"quantization_config": qc}, "cpu")
    assert "\n" not in str(e.value)


def test_bad_tensors_name_the_tensor():
    n_in, out = 96, 64
    spec = QuantSpec("awq", bits=4, group_size=64)
    get = {}.__getitem__
    with pytest.raises(ValueError, match="group_size 64 does not divide the input dimension 96 of x"):
        linear_leaves(spec, get, "x", n_in, out)
    fp8 = QuantSpec("fp8", checkpoint="fp8")
    import ml_dtypes
    w = np.zeros((out, n_in), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="checkpoint lacks tensor 'x.weight_scale'"):
        linear_leaves(fp8, getter({"x.weight": w}), "x", n_in, out)
    with pytest.raises(ValueError, match="tensor x.weight is float32"):
        linear_leaves(fp8, getter({"x.weight": w.astype(np.float32)}), "x", n_in, out)
    with pytest.raises(ValueError, match=r"tensor x.qweight has shape \(96, 4\), expected \(96, 8\)"):
        linear_leaves(QuantSpec("awq", bits=4, group_size=32), getter(
            {"x.qweight": np.zeros((96, 4), np.int32)}), "x", n_in, out)


def test_unknown_quantization_value_and_converted_folders(tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")
    (tmp_path / "params").mkdir()
    (tmp_path / "config.json").write_text(json.dumps({}))
    from jaxkv.engine.setup import load_params
    from types import SimpleNamespace
    with pytest.raises(ValueError, match="jaxkv convert"):
        load_params(SimpleNamespace(load_format="auto", model=str(tmp_path)),
                    SimpleNamespace(quant=QuantSpec("fp8")), None, None)


def test_a_tensor_parallel_split_keeps_int4_groups_whole():
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.quantization import check_tensor_parallel
    mc = ModelConfig.from_hf_config(read_config(None))  # o_proj 576 inputs, down_proj 1536
    check_tensor_parallel(QuantSpec("awq", bits=4, group_size=64), mc, 3)  # 9 and 24 groups
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the 9 input groups "
                                         "of o_proj"):
        check_tensor_parallel(QuantSpec("awq", bits=4, group_size=64), mc, 2)


def test_shapes_and_configs_that_do_not_fit_fail_in_one_line(tmp_path):
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.quantization import check_layer_shapes
    mc = ModelConfig.from_hf_config(read_config(None))  # inputs 576 and 1536
    with pytest.raises(ValueError, match="group_size 128 does not divide the 576 inputs of q_proj"):
        check_layer_shapes(QuantSpec("awq", bits=4, group_size=128), mc)
    check_layer_shapes(QuantSpec("awq", bits=4, group_size=64), mc)
    assert resolve(None, {"quantization_config": {**AWQ, "version": None}}, "cpu").method == "awq"
    for qc, match in (({"quant_method": "compressed-tensors", "config_groups": [{}]}, "config_groups must"),
                      ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": "x"}}},
                       "config_groups.g.weights must"),
                      ({**AWQ, "group_size": True}, "group_size"), ("awq", "quantization_config must")):
        with pytest.raises(ValueError, match=match):
            resolve(None, {"quantization_config": qc}, "cpu")
    from jaxkv.quantization import check_tensor_parallel
    check_tensor_parallel(QuantSpec("awq", bits=4, group_size=None), mc, 2)  # scales replicated


def test_bad_int4_tensors_name_the_tensor():
    spec = QuantSpec("gptq", bits=4, group_size=32, act_order=True, zero_offset=1)
    n_in, out = 64, 16
    good = {"x.qweight": np.zeros((8, 16), np.int32), "x.qzeros": np.zeros((2, 2), np.int32),
            "x.scales": np.ones((2, 16), np.float16), "x.g_idx": np.arange(64) // 32}

    def get(t):
        return lambda name: t[name]
    linear_leaves(spec, get(good), "x", n_in, out)
    with pytest.raises(ValueError, match="tensor x.qweight is float32"):
        linear_leaves(spec, get({**good, "x.qweight": good["x.qweight"].astype(np.float32)}), "x", n_in, out)
    bad = np.arange(64) // 32
    bad[0] = -1
    with pytest.raises(ValueError, match="x.g_idx does not give every group 32 inputs"):
        linear_leaves(spec, get({**good, "x.g_idx": bad}), "x", n_in, out)


def test_bad_pack_quantized_tensors_name_the_tensor():
    """compressed-tensors int4: zero points a non-symmetric scheme needs, a weight_shape that
    disagrees with the model, a packed tensor of the wrong shape: each named."""
    n_in, out = 64, 16
    good = {"x.weight_packed": np.zeros((16, 8), np.int32), "x.weight_scale": np.ones((16, 2), np.float32),
            "x.weight_zero_point": np.zeros((2, 2), np.int32), "x.weight_shape": np.array([16, 64])}
    get = getter
    asym = QuantSpec("pack-quantized", bits=4, group_size=32, checkpoint="compressed-tensors")
    assert linear_leaves(asym, get(good), "x", n_in, out)["zeros"].shape == (2, 16)
    no_zp = {k: v for k, v in good.items() if k != "x.weight_zero_point"}
    with pytest.raises(ValueError, match="lacks tensor 'x.weight_zero_point'"):
        linear_leaves(asym, get(no_zp), "x", n_in, out)
    sym = QuantSpec("pack-quantized", bits=4, group_size=32, symmetric=True)
    assert (linear_leaves(sym, get(no_zp), "x", n_in, out)["zeros"] == 8).all()
    with pytest.raises(ValueError, match=r"x.weight_shape is \(16, 32\), expected \(16, 64\)"):
        linear_leaves(asym, get({**good, "x.weight_shape": np.array([16, 32])}), "x", n_in, out)
    with pytest.raises(ValueError, match=r"tensor x.weight_packed has shape \(8, 16\)"):
        linear_leaves(asym, get({**good, "x.weight_packed": np.zeros((8, 16), np.int32)}), "x", n_in, out)
    # actorder group ("group", its older spelling True): weight_g_idx is read, and must be there
    # and give every group its inputs
    for actorder in ("group", True):
        spec = resolve(None, {"quantization_config": ct({**W4, "actorder": actorder})}, "cpu")
        assert spec.act_order and spec.method == "pack-quantized"
    order = {**good, "x.weight_g_idx": (np.arange(n_in) % 2).astype(np.int32)}
    act = QuantSpec("pack-quantized", bits=4, group_size=32, act_order=True)
    assert (linear_leaves(act, get(order), "x", n_in, out)["perm"][:32] == np.arange(0, 64, 2)).all()
    with pytest.raises(ValueError, match="lacks tensor 'x.weight_g_idx'"):
        linear_leaves(act, get(good), "x", n_in, out)
    with pytest.raises(ValueError, match="x.weight_g_idx does not give every group 32 inputs"):
        linear_leaves(act, get({**good, "x.weight_g_idx": np.zeros(n_in, np.int32)}), "x", n_in, out)


def test_convert_refuses_quantized_checkpoints(tmp_path):
    from jaxkv.loader.converted import convert
    from tests.models.test_quantized_checkpoints import _write
    (tmp_path / "ck").mkdir()
    _write("fp8", tmp_path / "ck")
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        convert(str(tmp_path / "ck"), str(tmp_path / "out"))
