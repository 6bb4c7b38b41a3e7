"""llama.cpp's Q8_0, Q4_0 and Q4_1 blocks kept quantized (--quantization gguf), numpy side.

A block holds 32 consecutive values of a row (the input dimension) and a float16 scale d:
Q8_0 stores 32 int8 (w = d * q; 34 bytes), Q4_0 16 bytes of nibbles (w = d * (q - 8);
18 bytes), Q4_1 a float16 min m too (w = d * q + m; 20 bytes); in a Q4 block byte j holds
value j in its low nibble and value j + 16 in its high one (ggml-quants.c). jaxkv keeps each
tensor as its values q, scales d and mins (m, or -8 d for Q4_0, or 0 for Q8_0), so one
layout serves the three: w = q * scale + min per group of 32 (jaxkv/quantization/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32
KINDS = ("Q8_0", "Q4_0", "Q4_1")  # the block types --quantization gguf keeps
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@dataclass
class GGUFBlocks:
    """One tensor's blocks, unpacked: q [rows, cols] (int8 for Q8_0, uint8 0..15 for Q4_x),
    scales and mins float16 [rows, cols / 32]; rows are the output dimension."""
    kind: str
    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray

    @property
    def shape(self) -> tuple:
        return self.q.shape

    @property
    def size(self) -> int:
        return self.q.size

    def rows(self, fn) -> GGUFBlocks:
        """The same blocks with `fn` applied to the rows of each array (q/k un-permuting)."""
        return GGUFBlocks(self.kind, fn(self.q), fn(self.scales), fn(self.mins))

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols], as gguf's own dequantize computes it."""
        r, c = self.q.shape
        q = self.q.astype(np.float32).reshape(r, c // GROUP, GROUP)
        w = q * self.scales.astype(np.float32)[..., None] + self.mins.astype(np.float32)[..., None]
        return w.reshape(r, c)


def from_raw(raw: np.ndarray, kind: str, shape: tuple) -> GGUFBlocks:
    """raw uint8 [rows, row_bytes] of a tensor of `shape` ([rows, cols]) -> GGUFBlocks."""
    rows, cols = shape
    b = raw.reshape(rows, cols // GROUP, _BLOCK_BYTES[kind])
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        q = b[..., 2:].copy().view(np.int8)
        mins = np.zeros_like(d)
    else:
        start = 4 if kind == "Q4_1" else 2
        nib = b[..., start:start + 16]
        q = np.concatenate([nib & 15, nib >> 4], axis=-1)
        mins = b[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else (-8 * d).astype(np.float16)
    return GGUFBlocks(kind, q.reshape(rows, cols), d, mins)


def quantize(w: np.ndarray, bits: int) -> GGUFBlocks:
    """Float [rows, cols] -> blocks as llama.cpp's Q8_0 (bits 8) or Q4_1 (bits 4) round them
    (random weights for dummy loads and benchmarks)."""
    r, c = w.shape
    g = np.asarray(w, np.float32).reshape(r, c // GROUP, GROUP)
    if bits == 8:
        d = (np.abs(g).max(-1) / 127).astype(np.float16)
        q = np.round(g / np.maximum(d.astype(np.float32), 1e-12)[..., None]).astype(np.int8)
        return GGUFBlocks("Q8_0", q.reshape(r, c), d, np.zeros_like(d))
    lo, hi = g.min(-1), g.max(-1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    q = np.round((g - m.astype(np.float32)[..., None]) / np.maximum(d.astype(np.float32), 1e-12)[..., None])
    return GGUFBlocks("Q4_1", np.clip(q, 0, 15).astype(np.uint8).reshape(r, c), d, m)


def leaves(blocks: GGUFBlocks, bits: int) -> dict:
    """The linear leaves ([in, out] orientation) of a tensor's blocks: "qweight" (uint8
    [in / 2, out], two values a byte, for bits 4; int8 [in, out] for bits 8), "scales" and
    "mins" float16 [in / 32, out]."""
    q = blocks.q.T
    if bits == 4:
        if blocks.kind == "Q8_0":
            raise ValueError("a Q8_0 tensor does not fit 4-bit storage")
        q = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)
    else:
        q = q.astype(np.int8)
    return {"qweight": np.ascontiguousarray(q), "scales": np.ascontiguousarray(blocks.scales.T),
            "mins": np.ascontiguousarray(blocks.mins.T)}
