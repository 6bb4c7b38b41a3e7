"""Build a step's StepInput on the host from a SchedulerOutput (numpy only)."""

from __future__ import annotations

import functools
import itertools

import numpy as np

from jaxkv.core.scheduler_output import SchedulerOutput
from jaxkv.sampling.rows import sampling_arrays
from jaxkv.step_input import StepInput


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), float32 [T, D / 2], of positions [T] x inv_freq [D / 2] (float32): the angle
    is the float32 product, as transformers' rotary embedding computes it, and its cos and
    sin are evaluated in float64 and rounded to float32."""
    angles = (positions.astype(np.float32)[:, None] * inv_freq[None].astype(np.float32))
    angles = angles.astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def build_step_input(out: SchedulerOutput, *, block_size: int, num_tokens: int, rows: int,
                     max_blocks: int, rope_table: tuple[np.ndarray, np.ndarray],
                     mark_decode_only: bool = False, prev_rows: int = 0,
                     fused_sampling: bool = False) -> StepInput:
    """The padded arrays of `out` (shapes in StepInput: T = num_tokens, R = rows,
    B = max_blocks; the rotary tables looked up by position in `rope_table`, the model's
    (cos, sin) of positions 0 .. max_model_len - 1, float32 [max_model_len, head_dim / 2],
    made once at start-up by rope_tables, as vLLM keeps its cos_sin_cache).
    `mark_decode_only`: set StepInput.decode_only when every scheduled sequence has exactly
    one query token (only for attention backends that use it: each value is a program of
    its own). `prev_rows` P > 0 (async scheduling): prev_sampled two zero arrays [P] and
    prev_index all -1 (no row from an earlier step: a step run ahead sets its own).
    `fused_sampling` (a bucket whose program samples, jaxkv/sampling/fused_sampling.py):
    StepInput.sampling holds padding rows [R] (sample_mode 0: nothing sampled there)."""
    i32, sched = np.int32, out.scheduled
    m = len(sched)  # vectorized over the step's sequences: no numpy call per sequence
    n = np.fromiter((len(sr.token_ids) for sr in sched), i32, m)
    c = np.fromiter((sr.num_computed_tokens for sr in sched), i32, m)
    qsl = np.zeros(rows + 1, i32)
    np.cumsum(n, out=qsl[1:m + 1])
    t = int(qsl[m])
    qsl[m + 1:] = t
    ids = np.zeros(num_tokens, i32)
    ids[:t] = np.fromiter(itertools.chain.from_iterable(sr.token_ids for sr in sched), i32, t)
    seq = np.repeat(np.arange(m, dtype=i32), n)  # each token's sequence
    pos = np.zeros(num_tokens, i32)
    pos[:t] = np.arange(t, dtype=i32) + np.repeat(c - qsl[:m], n)
    lens = np.fromiter((len(sr.block_ids) for sr in sched), i32, m)
    tables = np.zeros((rows, max_blocks), i32)
    nb = int(lens.sum())
    tables[np.repeat(np.arange(m), lens), np.arange(nb) - np.repeat(np.cumsum(lens) - lens, lens)] = \
        np.fromiter(itertools.chain.from_iterable(sr.block_ids for sr in sched), i32, nb)
    if not (pos[:t] // block_size < lens[seq]).all():
        raise ValueError("a scheduled position lies past its sequence's block table")
    slots = np.zeros(num_tokens, i32)
    slots[:t] = tables[seq, pos[:t] // block_size] * block_size + pos[:t] % block_size
    seq_lens = np.zeros(rows, i32)
    seq_lens[:m] = c + n
    logits_idx = np.zeros(rows, i32)
    logits_idx[:m] = qsl[1:m + 1] - 1
    decode_only = mark_decode_only and bool((n == 1).all())
    cos, sin = rope_table[0][pos], rope_table[1][pos]
    prev = (_zeros(prev_rows),) * 2 if prev_rows else None
    return StepInput(ids, pos, slots, tables, seq_lens, qsl, np.array([m], i32),
                     logits_idx, cos, sin, np.zeros(1, i32),
                     padding_sampling(rows) if fused_sampling else None, prev,
                     np.full(num_tokens, -1, i32) if prev_rows else None, decode_only=decode_only)


@functools.lru_cache(maxsize=8)
def _zeros(n: int) -> np.ndarray:
    z = np.zeros(n, np.int32)
    z.flags.writeable = False  # shared by every step
    return z


def decode_step_input(pos: np.ndarray, tables: np.ndarray, prev_sampled: tuple, prev_index: np.ndarray,
                      sampling, sample_mode: np.ndarray, *, block_size: int, num_tokens: int, rows: int,
                      max_blocks: int, rope_table, mark_decode_only: bool) -> StepInput:
    """The StepInput of a decode step run ahead, from arrays (jaxkv/runner/steady_batch.py):
    sequence i has one query row, at position pos[i] (int32 [m]), with block table row
    tables[i] (int32 [m, <= B]); its input id is prev_sampled's row prev_index[i] (int32 [m]);
    `sampling` and `sample_mode` as StepInput's. Padded as build_step_input pads (T =
    num_tokens, R = rows, B = max_blocks)."""
    i32, m = np.int32, len(pos)
    positions, slots, prev = np.zeros(num_tokens, i32), np.zeros(num_tokens, i32), np.full(num_tokens, -1, i32)
    positions[:m], prev[:m] = pos, prev_index
    table = np.zeros((rows, max_blocks), i32)
    table[:m, :tables.shape[1]] = tables
    slots[:m] = table[np.arange(m), pos // block_size] * block_size + pos % block_size
    seq_lens, logits_idx = np.zeros(rows, i32), np.zeros(rows, i32)
    seq_lens[:m], logits_idx[:m] = pos + 1, np.arange(m)
    qsl = np.full(rows + 1, m, i32)
    qsl[:m + 1] = np.arange(m + 1)
    return StepInput(np.zeros(num_tokens, i32), positions, slots, table, seq_lens, qsl, np.array([m], i32),
                     logits_idx, rope_table[0][positions], rope_table[1][positions], sample_mode, sampling,
                     prev_sampled, prev, decode_only=mark_decode_only)


def pending_sources(si: StepInput, idx: np.ndarray):
    """RowSampler.dispatch's `pending` for the sampled rows `idx` (int [n], token rows) of
    step `si`: (prev0, prev1, their prev_index) when every such row's input token is taken
    on the device from the step before (a step run ahead: that token is also the row's last
    output, not on the host yet), else None."""
    if si.prev_index is None or not len(idx):
        return None
    src = si.prev_index[idx]
    return (*si.prev_sampled, src) if (src >= 0).all() else None


@functools.lru_cache(maxsize=8)
def padding_sampling(r: int):
    """The sampler's arrays of r padding rows (sampling_arrays([], r)), read-only, shared."""
    s = sampling_arrays([], r)
    for a in s:
        a.flags.writeable = False  # shared by every step
    return s
