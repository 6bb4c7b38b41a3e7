"""A quantized linear layer's leaves in the Flax parameter tree, and its matmul (JAX).

Leaves by QuantSpec.method (kernel layout [in, out], as jaxkv's float kernels):
- fp8: "kernel" float8_e4m3fn [in, out], "scale" float32 [out]; W = kernel * scale.
- awq / gptq: "qweight" uint8 [in / 2, out] (input row 2i in the low nibble, 2i + 1 in the
  high one), "scales" float16 [groups, out], "zeros" uint8 [groups, out] (the zero points as
  stored, before QuantSpec.zero_offset), and with act-order "perm" int32 [in] (the inputs in
  group order); W[i] = (q[i] - zero[g] - zero_offset) * scale[g] for the group g of input i.
- gguf: "qweight" as above for 4 bits, int8 [in, out] for 8, "scales" and "mins" float16
  [in / 32, out]; W[i] = q[i] * scale[g] + min[g] (jaxkv/quantization/gguf.py).
The embedding kept quantized (gguf) is a layer of these leaves too, [hidden, vocab]: the LM
head's orientation (`QuantizedEmbed` in jaxkv/models/llama.py). A mixture of experts' experts
hold the same leaves stacked along a leading expert axis (`declare_experts`), widened to the
model's dtype for the grouped matmul (`dequantize_experts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.quantization import FP8_MAX, QuantSpec


LEAVES = ("kernel", "scale", "qweight", "scales", "zeros", "mins", "perm")


def num_groups(spec: QuantSpec, in_features: int) -> int:
    return 1 if spec.group_size is None else in_features // spec.group_size


def leaf_shapes(spec: QuantSpec, in_features: int, out: int) -> dict:
    """Leaf name -> (shape, dtype) of one layer of `spec`."""
    if spec.method == "fp8":
        return {"kernel": ((in_features, out), jnp.float8_e4m3fn), "scale": ((out,), jnp.float32)}
    g = num_groups(spec, in_features)
    packed = ((in_features // 2, out), jnp.uint8) if spec.bits == 4 else ((in_features, out), jnp.int8)
    leaves = {"qweight": packed, "scales": ((g, out), jnp.float16)}
    if spec.method == "gguf":
        leaves["mins"] = ((g, out), jnp.float16)
    else:
        leaves["zeros"] = ((g, out), jnp.uint8)
    if spec.act_order:
        leaves["perm"] = ((in_features,), jnp.int32)
    return leaves


def declare(module, spec: QuantSpec, in_features: int, out: int) -> dict:
    """The layer's leaves as params of the Flax `module` (zeros until loaded)."""
    return {name: module.param(name, jax.nn.initializers.zeros, shape, dtype)
            for name, (shape, dtype) in leaf_shapes(spec, in_features, out).items()}


def declare_experts(module, spec: QuantSpec, num: int, in_features: int, out: int) -> dict:
    """`num` experts' leaves, each of leaf_shapes' shape behind a leading expert axis."""
    return {name: module.param(name, jax.nn.initializers.zeros, (num, *shape), dtype)
            for name, (shape, dtype) in leaf_shapes(spec, in_features, out).items()}


def dequantize_experts(w: dict, spec: QuantSpec, dtype) -> jax.Array:
    """Stacked experts' leaves -> their weights [E, in, out] in `dtype`, in the inputs' own
    order (act-order rows put back from group order with the inverse of "perm")."""
    body = {k: v for k, v in w.items() if k != "perm"}
    deq = jax.vmap(lambda leaves: dequantize(leaves, spec, dtype))(body)
    if "perm" in w:
        inverse = jnp.argsort(w["perm"], axis=-1)
        deq = jnp.take_along_axis(deq, inverse[..., None], axis=1)
    return deq


def dequantize(w: dict, spec: QuantSpec, dtype) -> jax.Array:
    """The layer's weights [in, out] in `dtype` (float32 arithmetic)."""
    if spec.method == "fp8":
        return (w["kernel"].astype(jnp.float32) * w["scale"]).astype(dtype)
    q = w["qweight"]
    if spec.bits == 4:
        q = jnp.stack([q & 15, q >> 4], axis=1).reshape(-1, q.shape[-1])
    groups = w["scales"].shape[0]
    q = q.astype(jnp.float32).reshape(groups, -1, q.shape[-1])
    if "zeros" in w:
        q = q - (w["zeros"].astype(jnp.float32) + spec.zero_offset)[:, None]
    out = q * w["scales"].astype(jnp.float32)[:, None]
    if "mins" in w:
        out = out + w["mins"].astype(jnp.float32)[:, None]
    return out.reshape(-1, out.shape[-1]).astype(dtype)


def apply(x: jax.Array, w: dict, spec: QuantSpec, dtype) -> jax.Array:
    """x [T, in] -> [T, out] in `dtype`. fp8 with fp8_activations: each row of x quantized to
    float8 e4m3 with its own scale (max|row| / 448), the product of the two float8 operands
    accumulated in float32, then both scales applied. Otherwise the weights are widened to
    `dtype` inside the step (XLA fuses the dequantization into the program)."""
    if spec.method == "fp8" and spec.fp8_activations:
        xf = x.astype(jnp.float32)
        sx = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX, 1e-12)
        xq = jnp.clip(xf / sx, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
        y = jax.lax.dot(xq, w["kernel"], preferred_element_type=jnp.float32)
        return (y * sx * w["scale"]).astype(dtype)
    if spec.method == "fp8":
        y = jnp.dot(x.astype(dtype), w["kernel"].astype(dtype), preferred_element_type=jnp.float32)
        return (y * w["scale"]).astype(dtype)
    if "perm" in w:
        x = jnp.take(x, w["perm"], axis=-1)
    if _int4_kernel_fits(x, w, spec):
        from pallas_kernels.int4_matmul import int4_matmul
        n = w["qweight"].shape[1]
        return int4_matmul(x.astype(dtype), w["qweight"], w["scales"], w["zeros"],
                           zero_offset=spec.zero_offset, block_n=64 if n % 64 == 0 else 16,
                           interpret=jax.default_backend() == "cpu")
    return x.astype(dtype) @ dequantize(w, spec, dtype)


INT4_KERNEL_ROWS = 64  # above: the weights widened once and one dense matmul (prefill)


def _int4_kernel_fits(x, w: dict, spec: QuantSpec) -> bool:
    """Whether pallas_kernels.int4_matmul takes this matmul: asked for (spec.int4_kernel),
    few rows, 4-bit values with zero points, groups of 32-256 inputs (a power of two: each
    group's half is one dot operand), outputs a multiple of 16."""
    if not spec.int4_kernel or spec.bits != 4 or "zeros" not in w or x.shape[0] > INT4_KERNEL_ROWS:
        return False
    k, n = x.shape[-1], w["qweight"].shape[1]
    group = k // w["scales"].shape[0]
    return 32 <= group <= 256 and group & (group - 1) == 0 and n % 16 == 0


def embedding_spec(spec: QuantSpec) -> QuantSpec:
    """The spec of gguf's embedding kept quantized (its own bits)."""
    return QuantSpec("gguf", bits=spec.embedding_bits, group_size=spec.group_size)


def take_columns(w: dict, ids: jax.Array, spec: QuantSpec, dtype) -> jax.Array:
    """Rows `ids` of an embedding held as [hidden, vocab] leaves: [len(ids), hidden] in
    `dtype` (only those columns are dequantized)."""
    cols = {k: jnp.take(v, ids, axis=1) for k, v in w.items()}
    return dequantize(cols, spec, dtype).T


def dummy_leaf(name: str, shape: tuple, dtype, key, spec: QuantSpec) -> jax.Array:
    """Random values of a quantized leaf (load_format="dummy") whose weights come out about
    normal(0, 0.02): drawn on the device, no float copy of the model is ever made."""
    bits8 = spec.bits == 8 and spec.method != "fp8"
    step = 0.02 / (73.0 if bits8 else 4.6)  # the std of uniform int8 / uint4 values
    if name == "kernel":  # fp8
        return jnp.clip(jax.random.normal(key, shape) * 112.0, -FP8_MAX, FP8_MAX).astype(dtype)
    if name == "scale":
        return jnp.full(shape, 0.02 / 112.0, dtype)
    if name == "qweight":
        lo, hi = (-127, 128) if jnp.dtype(dtype) == jnp.int8 else (0, 256)
        return jax.random.randint(key, shape, lo, hi, jnp.int32).astype(dtype)
    if name == "scales":
        return jnp.full(shape, step, dtype)
    if name == "zeros":
        return jnp.full(shape, 8 - spec.zero_offset, dtype)
    if name == "mins":
        return jnp.full(shape, 0.0 if bits8 else -8 * step, dtype)
    if name == "perm":  # [in], or [experts, in]
        return jnp.broadcast_to(jnp.arange(shape[-1], dtype=dtype), shape)
    raise ValueError(f"no dummy values for leaf {name!r}")
