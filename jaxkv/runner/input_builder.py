"""Build a step's StepInput on the host from a SchedulerOutput (numpy only)."""

from __future__ import annotations

import numpy as np

from jaxkv.core.scheduler_output import SchedulerOutput
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
                     mark_decode_only: bool = False) -> StepInput:
    """The padded arrays of `out` (shapes in StepInput: T = num_tokens, R = rows,
    B = max_blocks; the rotary tables looked up by position in `rope_table`, the model's
    (cos, sin) of positions 0 .. max_model_len - 1, float32 [max_model_len, head_dim / 2],
    made once at start-up by rope_tables, as vLLM keeps its cos_sin_cache).
    `mark_decode_only`: set StepInput.decode_only when every scheduled sequence has exactly
    one query token (only for attention backends that use it: each value is a program of
    its own)."""
    i32 = np.int32
    ids = np.zeros(num_tokens, i32)
    pos = np.zeros(num_tokens, i32)
    slots = np.zeros(num_tokens, i32)
    tables = np.zeros((rows, max_blocks), i32)
    seq_lens = np.zeros(rows, i32)
    qsl = np.zeros(rows + 1, i32)
    logits_idx = np.zeros(rows, i32)
    t = 0
    for s, sr in enumerate(out.scheduled):
        n, c = sr.num_scheduled_tokens, sr.num_computed_tokens
        p = np.arange(c, c + n, dtype=i32)
        bt = np.asarray(sr.block_ids, i32)
        ids[t:t + n] = sr.token_ids
        pos[t:t + n] = p
        slots[t:t + n] = bt[p // block_size] * block_size + p % block_size
        tables[s, :len(bt)] = bt
        seq_lens[s] = c + n
        t += n
        qsl[s + 1] = t
        logits_idx[s] = t - 1
    qsl[len(out.scheduled) + 1:] = t
    decode_only = mark_decode_only and all(s.num_scheduled_tokens == 1 for s in out.scheduled)
    cos, sin = rope_table[0][pos], rope_table[1][pos]
    return StepInput(ids, pos, slots, tables, seq_lens, qsl, np.array([len(out.scheduled)], i32),
                     logits_idx, cos, sin, np.zeros(1, i32), decode_only=decode_only)
