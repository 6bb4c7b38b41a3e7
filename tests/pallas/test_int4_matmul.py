"""pallas_kernels.int4_matmul: x @ packed 4-bit weights, dequantized inside the kernel.
Interpret mode on the CPU against jaxkv's own dequantization (jaxkv/quantization/linear.py),
the argument checks, the Pallas -> Triton lowering for the Llama-3-8B layer shapes (no GPU
needed), a tiny AWQ model through the kernel against transformers, and on a GPU the kernel
compiled natively (marked gpu)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.quantization import QuantSpec
from jaxkv.quantization import linear as qlinear
from pallas_kernels.int4_matmul import _int4_matmul, int4_matmul


def packed(rng, k, n, group):
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    return {"qweight": jnp.asarray(q[0::2] | (q[1::2] << 4)),
            "scales": jnp.asarray((rng.random((k // group, n)) * 0.02 + 1e-3).astype(np.float16)),
            "zeros": jnp.asarray(rng.integers(0, 16, (k // group, n)).astype(np.uint8))}


@pytest.mark.parametrize("m,k,n,group,dtype,offset", [
    (1, 256, 128, 64, jnp.float32, 0), (5, 128, 64, 32, jnp.float32, 1),
    (33, 512, 64, 128, jnp.bfloat16, 0), (16, 256, 32, 256, jnp.float16, 0)])
def test_interpret_mode_equals_the_dequantized_product(m, k, n, group, dtype, offset):
    rng = np.random.default_rng(m)
    w = packed(rng, k, n, group)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    spec = QuantSpec("gptq", bits=4, group_size=group, zero_offset=offset)
    ref = x.astype(jnp.float32) @ qlinear.dequantize(w, spec, jnp.float32)
    got = int4_matmul(x, w["qweight"], w["scales"], w["zeros"], zero_offset=offset,
                      block_n=32 if n % 64 else 64, interpret=True)
    assert got.shape == (m, n) and got.dtype == dtype
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    assert err < (1e-5 if dtype == jnp.float32 else 1e-2), err


def test_bad_arguments_name_the_argument():
    rng = np.random.default_rng(0)
    w = packed(rng, 256, 128, 64)
    x = jnp.ones((2, 256), jnp.float32)
    cases = [(dict(x=x.astype(jnp.int32)), "x must be float32"),
             (dict(x=jnp.ones((2, 128))), r"qweight must be uint8 \[K / 2 = 64, N\]"),
             (dict(zeros=w["zeros"][:2]), "scales and zeros must be"),
             (dict(block_n=48), "block_n 48 must be a power of two"),
             (dict(scales=jnp.ones((16, 128), jnp.float16), zeros=jnp.zeros((16, 128), jnp.uint8)),
              "group size 16 must be a power of two >= 32")]
    for change, match in cases:
        args = {**w, "x": x, "block_n": 64, **change}
        with pytest.raises(ValueError, match=match):
            int4_matmul(args["x"], args["qweight"], args["scales"], args["zeros"],
                        block_n=args["block_n"], interpret=True)


@pytest.mark.parametrize("m,k,n,group", [(1, 4096, 4096, 128), (16, 14336, 4096, 128),
                                         (64, 4096, 14336, 128), (1, 4096, 1024, 32)])
def test_it_lowers_to_triton_for_the_llama3_8b_layers(m, k, n, group):
    from tests.pallas.test_triton_lowering import TRITON_CALL, lower_for_h200
    sd = jax.ShapeDtypeStruct
    f = jax.jit(lambda x, q, s, z: _int4_matmul(x, q, s, z, zero_offset=0, block_n=64,
                                                num_warps=4, num_stages=2, interpret=False))
    text = lower_for_h200(f, sd((m, k), jnp.bfloat16), sd((k // 2, n), jnp.uint8),
                          sd((k // group, n), jnp.float16), sd((k // group, n), jnp.uint8))
    assert TRITON_CALL in text


def test_an_awq_model_through_the_kernel_gives_transformers_logits(tmp_path):
    """The engine's path on a GPU (QuantSpec.int4_kernel, set there for one device), here in
    interpret mode: the decode steps' and chunks' matmuls of at most 64 rows go through the
    kernel; logits within 1e-3 of transformers on the dequantized weights."""
    from jaxkv.loader.hf import load_hf_dir
    from jaxkv.models.llama import LlamaModel
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.models.params import params_from_tensors
    from jaxkv.quantization import resolve
    from tests.models.hf_compare import assert_logits_match
    from tests.models.test_architectures import COMMON
    from tests.models.test_quantized_checkpoints import _write
    hf = _write("awq", tmp_path)
    ckpt = load_hf_dir(str(tmp_path))
    mc = ModelConfig.from_hf_config(ckpt.config)
    spec = dataclasses.replace(resolve(None, ckpt.config, "cpu"), int4_kernel=True)
    model = LlamaModel(mc, quant=spec)
    params = params_from_tensors(model, ckpt.tensors)
    x = jnp.ones((3, mc.hidden_size), jnp.float32)
    assert qlinear._int4_kernel_fits(x, params["layers_0"]["q_proj"], spec)
    assert_logits_match(hf, model, params, mc, COMMON["vocab_size"], 1e-3, "awq, int4 kernel",
                        quantization_config=ckpt.config["quantization_config"])


@pytest.mark.gpu
def test_native_kernel_on_a_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(1)
    w = packed(rng, 4096, 4096, 128)
    x = jnp.asarray(rng.standard_normal((1, 4096)), jnp.bfloat16)
    spec = QuantSpec("awq", bits=4, group_size=128)
    ref = x.astype(jnp.float32) @ qlinear.dequantize(w, spec, jnp.float32)
    got = int4_matmul(x, w["qweight"], w["scales"], w["zeros"]).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))) < 1e-2


def test_split_k_with_an_uneven_last_share(monkeypatch):
    """5 groups over 3 programs along K (2, 2 and 1 groups): the partial products sum to the
    whole one."""
    import pallas_kernels.int4_matmul as im
    monkeypatch.setattr(im, "MIN_PROGRAMS", 6)  # 2 column tiles x 3 splits
    rng = np.random.default_rng(5)
    w = packed(rng, 160, 128, 32)
    x = jnp.asarray(rng.standard_normal((3, 160)), jnp.float32)
    ref = x @ qlinear.dequantize(w, QuantSpec("awq", bits=4, group_size=32), jnp.float32)
    got = im.int4_matmul(x, w["qweight"], w["scales"], w["zeros"], block_n=64, interpret=True)
    assert float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))) < 1e-5
