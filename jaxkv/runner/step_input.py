"""StepInput: the padded host arrays of one step, built from a SchedulerOutput (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxkv.core.scheduler_output import SchedulerOutput


@dataclass
class StepInput:
    """All int32. T = token bucket, R = sampling rows (max sequences this step), B = block-table width.

    input_ids, positions, slot_mapping: [T] (padding rows: id 0, position 0, slot 0 = null block);
    block_tables [R, B] (padding entries 0); seq_lens [R] (0 = padding row);
    query_start_loc [R + 1]; num_seqs [1]; logits_indices [R]: each sequence's last token row.
    """
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    num_seqs: np.ndarray
    logits_indices: np.ndarray

    @property
    def attn_arrays(self):
        return (self.positions, self.slot_mapping, self.block_tables, self.seq_lens,
                self.query_start_loc, self.num_seqs)


def build_step_input(out: SchedulerOutput, *, block_size: int, num_tokens: int, rows: int,
                     max_blocks: int) -> StepInput:
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
    return StepInput(ids, pos, slots, tables, seq_lens, qsl, np.array([len(out.scheduled)], i32), logits_idx)
