"""Checkpoint tensors -> a quantized linear layer's leaves (numpy; the layout of
jaxkv/quantization/linear.py), and round-to-nearest quantizers for float weights.

Published layouts read (torch Linear order, [out, in], for the float and fp8 weights):
- fp8 (vLLM's format, llm-compressor's float-quantized): ``weight`` float8_e4m3fn [out, in],
  ``weight_scale`` float32 [] / [1] (per tensor) or [out] / [out, 1] (per channel);
  ``input_scale`` (static activation scales) is accepted and not used: activations get
  dynamic per-token scales.
- AWQ (AutoAWQ's GEMM version): ``qweight`` int32 [in, out / 8] and ``qzeros`` int32
  [groups, out / 8], eight 4-bit values per int32 along the output dimension in AWQ's
  interleaved order (nibble k holds column 8c + AWQ_ORDER[k]); ``scales`` float16 [groups, out].
- GPTQ: ``qweight`` int32 [in / 8, out] (eight inputs per int32, nibble k = input 8r + k),
  ``qzeros`` int32 [groups, out / 8] (nibble k = column 8c + k), ``scales`` float16
  [groups, out], ``g_idx`` int32 [in] (the group of each input; act-order when not i // group).
- compressed-tensors pack-quantized int4: ``weight_packed`` int32 [out, in / 8] (nibble k =
  input 8r + k, each the signed value + 8), ``weight_scale`` [out, groups] (any float dtype),
  ``weight_zero_point`` int32 [ceil(out / 8), groups] packed the same way along the outputs
  (absent when symmetric: zero 0), ``weight_shape`` [2] = (out, in).
"""

from __future__ import annotations

import numpy as np

from jaxkv.quantization import FP8_MAX, QuantSpec, gguf

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ int32 holds column AWQ_ORDER[k]


def quantize_fp8(w: np.ndarray) -> dict:
    """Float [in, out] -> fp8 leaves with one scale per output channel (max|W[:, j]| / 448).
    vLLM's online fp8 takes one scale per tensor; per channel costs nothing here (the leaf is
    per channel either way) and on the embedded model's ten chat prompts moved the mean
    first-token logprob difference from 0.250 to 0.197 nats (tests/engine/test_quantization.py)."""
    import ml_dtypes
    w = np.asarray(w, np.float32)
    scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / FP8_MAX
    kernel = np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return {"kernel": kernel, "scale": scale.astype(np.float32)}


def quantize_int4(w: np.ndarray, spec: QuantSpec) -> dict:
    """Float [in, out] -> int4 leaves, round to nearest per group with a zero point."""
    w = np.asarray(w, np.float32)
    n_in, out = w.shape
    g = spec.group_size or n_in
    wg = w.reshape(n_in // g, g, out)
    lo, hi = wg.min(axis=1), wg.max(axis=1)
    scales = np.maximum(hi - lo, 1e-8) / 15
    zeros = np.clip(np.round(-lo / scales), spec.zero_offset, 15)
    q = np.clip(np.round(wg / scales[:, None]) + zeros[:, None], 0, 15).astype(np.uint8)
    leaves = {"qweight": _pack_rows(q.reshape(n_in, out)), "scales": scales.astype(np.float16),
              "zeros": (zeros - spec.zero_offset).astype(np.uint8)}
    if spec.act_order:
        leaves["perm"] = np.arange(n_in, dtype=np.int32)
    return leaves


def _unpack_rows(packed: np.ndarray) -> np.ndarray:
    """_pack_rows undone: [in / 2, out] -> uint8 values 0..15 [in, out]."""
    return np.stack([packed & 15, packed >> 4], axis=1).reshape(-1, packed.shape[-1])


def _pack_rows(q: np.ndarray) -> np.ndarray:
    """uint8 values 0..15 [in, out] -> [in / 2, out], row 2i low nibble, 2i + 1 high."""
    return (q[0::2] | (q[1::2] << 4)).astype(np.uint8)


def _nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 [..] holding eight 4-bit values each -> uint8 with `axis` 8x longer (nibble k of
    element j becomes element 8j + k)."""
    p = packed.astype(np.uint32)
    parts = [((p >> (4 * k)) & 15).astype(np.uint8) for k in range(8)]
    stacked = np.stack(parts, axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 8
    return stacked.reshape(shape)


def linear_leaves(spec: QuantSpec, get, prefix: str, n_in: int, out: int) -> dict:
    """The leaves of the layer `prefix` (e.g. "model.layers.0.self_attn.q_proj"). `get(name)`
    returns a checkpoint tensor or raises ValueError naming it. ValueError naming the tensor
    for a missing tensor, a wrong shape, or a group size that does not divide the inputs."""
    if spec.method == "gguf":
        return _gguf_leaves(get(f"{prefix}.weight"), spec, prefix, n_in, out)
    if spec.method == "fp8" and spec.online:
        return quantize_fp8(np.asarray(get(f"{prefix}.weight"), np.float32).T)
    if spec.method == "fp8":
        return _fp8_leaves(get, prefix, n_in, out)
    if spec.group_size and n_in % spec.group_size:
        raise ValueError(f"quantization_config.group_size {spec.group_size} does not divide the "
                         f"input dimension {n_in} of {prefix}")
    g = spec.group_size or n_in
    if spec.method == "pack-quantized":
        leaves = _pack_quantized_leaves(get, prefix, n_in, out, g, spec.symmetric)
        if spec.act_order:  # the rows (two per byte) unpacked, put in group order, repacked
            q = _unpack_rows(leaves["qweight"])
            name = f"{prefix}.weight_g_idx"
            leaves["qweight"] = _pack_rows(_group_order(get(name), name, q, g, leaves))
        return leaves
    if spec.method == "awq":
        qweight = _int32(_shaped(get, f"{prefix}.qweight", (n_in, out // 8)), f"{prefix}.qweight")
        q = _nibbles(qweight, 1).reshape(n_in, out // 8, 8)[:, :, np.argsort(AWQ_ORDER)]
        q = q.reshape(n_in, out)
        zeros = _nibbles(_int32(_shaped(get, f"{prefix}.qzeros", (n_in // g, out // 8)),
                                f"{prefix}.qzeros"), 1)
        zeros = zeros.reshape(n_in // g, out // 8, 8)[:, :, np.argsort(AWQ_ORDER)].reshape(n_in // g, out)
    else:
        q = _nibbles(_int32(_shaped(get, f"{prefix}.qweight", (n_in // 8, out)), f"{prefix}.qweight"), 0)
        zeros = _nibbles(_int32(_shaped(get, f"{prefix}.qzeros", (n_in // g, out // 8)),
                                f"{prefix}.qzeros"), 1)
    leaves = {"scales": np.asarray(_shaped(get, f"{prefix}.scales", (n_in // g, out)), np.float16),
              "zeros": zeros.astype(np.uint8)}
    if spec.method == "gptq":
        q = _gptq_order(get, prefix, q, g, spec, leaves)
    leaves["qweight"] = _pack_rows(q)
    return leaves


def _pack_quantized_leaves(get, prefix: str, n_in: int, out: int, g: int, symmetric: bool) -> dict:
    """compressed-tensors int4: value - zero = (nibble - 8) - (zero nibble - 8), so the
    nibbles themselves are jaxkv's unsigned values and zero points (8 when symmetric)."""
    try:
        shape = tuple(int(x) for x in np.asarray(get(f"{prefix}.weight_shape")).reshape(-1))
    except ValueError:
        shape = (out, n_in)
    if shape != (out, n_in):
        raise ValueError(f"tensor {prefix}.weight_shape is {shape}, expected {(out, n_in)}")
    name = f"{prefix}.weight_packed"
    q = _nibbles(_int32(_shaped(get, name, (out, n_in // 8)), name), 1).T
    scales = np.asarray(_shaped(get, f"{prefix}.weight_scale", (out, n_in // g)), np.float32).T
    if symmetric:
        zeros = np.full(scales.shape, 8, np.uint8)
    else:
        name = f"{prefix}.weight_zero_point"
        zeros = _nibbles(_int32(_shaped(get, name, (-(-out // 8), n_in // g)), name), 0)[:out].T
    return {"qweight": _pack_rows(np.ascontiguousarray(q)), "scales": scales.astype(np.float16),
            "zeros": np.ascontiguousarray(zeros, np.uint8)}


def _gptq_order(get, prefix: str, q: np.ndarray, g: int, spec: QuantSpec, leaves: dict):
    """GPTQ's g_idx: the rows of q in group order (and "perm" with act-order)."""
    try:
        g_idx = get(f"{prefix}.g_idx")
    except ValueError:  # no g_idx: the plain order
        if spec.act_order:
            leaves["perm"] = np.arange(q.shape[0], dtype=np.int32)
        return q
    if spec.act_order:
        return _group_order(g_idx, f"{prefix}.g_idx", q, g, leaves)
    if not np.array_equal(np.asarray(g_idx).astype(np.int64), np.arange(q.shape[0]) // g):
        raise ValueError(f"{prefix}.g_idx reorders the inputs but quantization_config.desc_act "
                         "is false")
    return q


def _group_order(g_idx, name: str, q: np.ndarray, g: int, leaves: dict) -> np.ndarray:
    """Act-order: `g_idx`, tensor `name` (int [in]), gives each input's group; returns the
    rows of q [in, out] in group order and sets leaves["perm"] (the inputs in that order,
    int32 [in]). ValueError naming the tensor when it does not give every group g inputs."""
    n_in = q.shape[0]
    g_idx = np.asarray(g_idx).astype(np.int64)
    if (g_idx.shape != (n_in,) or g_idx.min() < 0 or g_idx.max() >= n_in // g
            or np.any(np.bincount(g_idx, minlength=n_in // g) != g)):
        raise ValueError(f"{name} does not give every group {g} inputs")
    perm = np.argsort(g_idx, kind="stable")
    leaves["perm"] = perm.astype(np.int32)
    return q[perm]


def _gguf_leaves(blocks, spec: QuantSpec, prefix: str, n_in: int, out: int) -> dict:
    if not isinstance(blocks, gguf.GGUFBlocks):
        raise ValueError(f"tensor {prefix}.weight is not in GGUF blocks (quantization gguf "
                         "reads a .gguf file's Q8_0 / Q4_0 / Q4_1 tensors)")
    if blocks.shape != (out, n_in):
        raise ValueError(f"tensor {prefix}.weight has shape {blocks.shape}, expected {(out, n_in)}")
    return gguf.leaves(blocks, spec.bits)


def _fp8_leaves(get, prefix: str, n_in: int, out: int) -> dict:
    import ml_dtypes
    w = _shaped(get, f"{prefix}.weight", (out, n_in))
    if w.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"tensor {prefix}.weight is {w.dtype}, an fp8 checkpoint stores "
                         "float8_e4m3fn")
    scale = np.asarray(get(f"{prefix}.weight_scale"), np.float32).reshape(-1)
    if scale.size not in (1, out):
        raise ValueError(f"tensor {prefix}.weight_scale has {scale.size} values; expected 1 "
                         f"(per tensor) or {out} (per channel)")
    return {"kernel": np.ascontiguousarray(w.T), "scale": np.broadcast_to(scale, (out,)).copy()}


def _int32(a: np.ndarray, name: str) -> np.ndarray:
    """A packed tensor must hold 32-bit integers (int32 as published, or uint32)."""
    if a.dtype not in (np.int32, np.uint32):
        raise ValueError(f"tensor {name} is {a.dtype}; packed 4-bit tensors are int32")
    return a


def _shaped(get, name: str, shape: tuple) -> np.ndarray:
    a = np.asarray(get(name))
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"tensor {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a
