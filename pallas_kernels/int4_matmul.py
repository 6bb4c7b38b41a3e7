"""x @ W for 4-bit weights kept packed, dequantized inside the kernel (weight-only int4: AWQ,
GPTQ and compressed-tensors int4 in jaxkv's layout, jaxkv/quantization/linear.py).

Layout: qweight uint8 [K / 2, N], input row 2i in the low nibble of packed row i and 2i + 1 in
the high one; scales float16 [K / G, N] and zeros uint8 [K / G, N] per group of G inputs;
W[k, n] = (q[k, n] - zeros[k // G, n] - zero_offset) * scales[k // G, n].

Algorithm: a weight-only quantized GEMM as in AWQ (Lin et al., MLSys 2024) and GPTQ's kernels
(Frantar et al., ICLR 2023): every program computes a [M, block_n] tile of the output, looping
over the groups of K; each step loads one group's packed rows [G / 2, block_n], widens the two
nibbles to the activations' dtype with the group's zero point and scale applied, and
accumulates two dots in float32. When the output columns give fewer than MIN_PROGRAMS tiles,
K is split too (split-K) and the float32 partial products are summed after the kernel. The nibble interleave is never undone: the activations come
split into their even and odd inputs (x[:, 0::2] and x[:, 1::2], a strided slice outside the
kernel), so the low nibbles multiply the even inputs and the high nibbles the odd ones. The
weights are read from memory once, at half a byte each: a decode step's matmuls are a weight
read, so this is the int4 speed-up.

GPU lowering: Pallas's Triton lowering (`plgpu.CompilerParams`), the same rules as the
attention kernels (pallas_kernels/validation.py): power-of-two tiles, dot operands of at least
16 in every dimension (M is padded to 16), one dtype per dot; interpret mode runs it on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DEFAULT_BLOCK_N = 64
MIN_PROGRAMS = 256


def _kernel(xe_ref, xo_ref, q_ref, s_ref, z_ref, o_ref, *, group, zero_offset, num_groups, per):
    # xe_ref, xo_ref: [Mp, K / 2] (even / odd inputs); q_ref: uint8 [K / 2, bn] (this tile's
    # columns); s_ref float16, z_ref uint8: [K / G, bn]; o_ref: float32 [1, Mp, bn], the
    # partial product of this program's groups (split-K: program j of axis 1 takes groups
    # j * per .. (j + 1) * per - 1)
    half = group // 2
    dt = xe_ref.dtype
    lo = pl.program_id(1) * per
    hi = jnp.minimum(lo + per, num_groups)

    def body(g, acc):
        rows = pl.ds(g * half, half)
        q = q_ref[rows, :].astype(jnp.int32)                       # [G / 2, bn]
        zero = z_ref[pl.ds(g, 1), :].astype(jnp.float32) + zero_offset  # [1, bn]
        scale = s_ref[pl.ds(g, 1), :].astype(jnp.float32)
        lo = (((q & 15).astype(jnp.float32) - zero) * scale).astype(dt)
        hi = (((q >> 4).astype(jnp.float32) - zero) * scale).astype(dt)
        acc += jnp.dot(xe_ref[:, rows], lo, preferred_element_type=jnp.float32)
        acc += jnp.dot(xo_ref[:, rows], hi, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(lo, hi, body, jnp.zeros(o_ref.shape[1:], jnp.float32))
    o_ref[0] = acc


@functools.partial(jax.jit, static_argnames=("zero_offset", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def _int4_matmul(x, qweight, scales, zeros, *, zero_offset, block_n, num_warps, num_stages,
                 interpret):
    m, k = x.shape
    n = qweight.shape[1]
    num_groups = scales.shape[0]
    mp = max(16, 1 << (m - 1).bit_length())  # a power of two, >= 16 rows (a dot's minimum)
    xp = jnp.pad(x, ((0, mp - m), (0, 0))) if mp != m else x
    xe, xo = xp[:, 0::2], xp[:, 1::2]
    # split-K: about MIN_PROGRAMS programs when the columns alone give fewer (an H200 has
    # 132 SMs; a k_proj of 1,024 columns is 16 tiles)
    splits = max(1, min(num_groups, MIN_PROGRAMS // (n // block_n)))
    per = -(-num_groups // splits)
    splits = -(-num_groups // per)
    kernel = functools.partial(_kernel, group=k // num_groups, zero_offset=zero_offset,
                               num_groups=num_groups, per=per)
    full = lambda rows: pl.BlockSpec((rows, k // 2), lambda j, s: (0, 0))  # noqa: E731
    cols = lambda rows: pl.BlockSpec((rows, block_n), lambda j, s: (0, j))  # noqa: E731
    parts = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((splits, mp, n), jnp.float32),
        grid=(n // block_n, splits),
        in_specs=[full(mp), full(mp), cols(k // 2), cols(num_groups), cols(num_groups)],
        out_specs=pl.BlockSpec((1, mp, block_n), lambda j, s: (s, 0, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int4_matmul",
    )(xe, xo, qweight, scales, zeros)
    return jnp.sum(parts, axis=0)[:m].astype(x.dtype)


def int4_matmul(x, qweight, scales, zeros, *, zero_offset: int = 0, block_n: int = DEFAULT_BLOCK_N,
                num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """x [M, K] (float32, bfloat16 or float16) @ the packed int4 weights -> [M, N] in x's dtype.

    qweight: uint8 [K / 2, N]; scales: float16 [K / G, N]; zeros: uint8 [K / G, N] (the layout
    of the module docstring); zero_offset: added to every zero point (1 for GPTQ's original
    format). block_n: output columns per program (a power of two >= 16 dividing N). M may be
    anything (padded to a power of two >= 16 inside). Raises ValueError naming the argument
    for shapes or dtypes the kernel does not take: K even, G even and >= 32 (each group's
    half a dot operand of >= 16 rows) and a power of two, N a multiple of block_n.
    """
    m, k = x.shape
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if qweight.dtype != jnp.uint8 or qweight.ndim != 2 or qweight.shape[0] * 2 != k:
        raise ValueError(f"qweight must be uint8 [K / 2 = {k // 2}, N], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n = qweight.shape[1]
    if scales.shape != zeros.shape or scales.ndim != 2 or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"scales and zeros must be [K / G, N = {n}] with G dividing K = {k}, got "
                         f"{tuple(scales.shape)} and {tuple(zeros.shape)}")
    group = k // scales.shape[0]
    if group < 32 or group & (group - 1):
        raise ValueError(f"group size {group} must be a power of two >= 32 (K = {k}, "
                         f"{scales.shape[0]} groups)")
    if block_n < 16 or block_n & (block_n - 1) or n % block_n:
        raise ValueError(f"block_n {block_n} must be a power of two >= 16 dividing N = {n}")
    return _int4_matmul(x, qweight, scales.astype(jnp.float16), zeros.astype(jnp.uint8),
                        zero_offset=int(zero_offset), block_n=block_n, num_warps=num_warps,
                        num_stages=num_stages, interpret=bool(interpret))
