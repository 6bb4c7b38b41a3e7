"""StepInput: the one device record of a step, a registered JAX pytree.

The runner builds it on the host from a SchedulerOutput (jaxkv/runner/input_builder.py,
numpy only) and passes it straight into the jitted step; the model and the attention backend
read its fields. `decode_only` is static (a pytree meta field): a step whose every sequence has
exactly one query token compiles its own program per token bucket, so the attention backend
can pick its decode kernel at trace time. `sample_mode` and `sampling` are data: in the
step programs that fuse sampling, the runner sets them when the step's sampled rows are all
plain and its program samples their tokens itself (jaxkv/sampling/fused_sampling.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

Array = jax.Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class StepInput:
    """int32 but for the rotary tables. T = token bucket, R = sequence rows (min(T,
    max_num_seqs)), B = blocks of a max_model_len sequence, D = head_dim. Padding token rows:
    id 0, position 0, slot 0 (the null block); padding sequence rows: seq_len 0, table entries
    0, query_start_loc repeating the end."""
    input_ids: Array        # [T] token ids of this step's query rows
    positions: Array        # [T] absolute position of each row
    slot_mapping: Array     # [T] slot = block_id * block_size + offset where the row's K/V goes
    block_tables: Array     # [R, B] physical block ids of each sequence's logical blocks
    seq_lens: Array         # [R] context length including this step's tokens (0 = padding)
    query_start_loc: Array  # [R + 1] first row of each sequence; cumulative query lengths
    num_seqs: Array         # [1] real sequence rows
    logits_indices: Array   # [R] each sequence's last row (the one sampled)
    # float32 [T, D / 2]: cos and sin of each row's position x the model's RoPE inverse
    # frequencies, computed on the host (inside the step XLA:CPU fused cos/sin into every
    # layer's RoPE and recomputed them for each head: 4-5 ms of a 64-sequence decode step)
    rope_cos: Array
    rope_sin: Array
    # Fused sampling (jaxkv/sampling/fused_sampling.py), in the programs that have it: [1],
    # 0 = no token is sampled in the program (the LM head is skipped), 1-3 = each sequence's
    # last row is sampled in sampler.MODES[mode - 1] with `sampling` (the sampler's per-row
    # parameters, [R] each: row i = sequence i); `sampling` None: a program without it.
    sample_mode: Array = dataclasses.field(default_factory=lambda: np.zeros(1, np.int32))
    sampling: object = None  # jaxkv.sampling.sampler.SamplingArrays or None
    # Async scheduling (jaxkv/runner/lookahead.py): a step dispatched before the previous
    # steps' sampled tokens reach the host takes them on the device. prev_sampled: two int32
    # [P] token arrays (those steps' sampler outputs, padded to P = max_num_seqs rows; the
    # same array twice when one step is the source); prev_index [T]: row t's input id is
    # concat(prev_sampled)[prev_index[t]] where it is >= 0, else input_ids[t]. None: no
    # such rows (a program without the gather).
    prev_sampled: tuple | None = None
    prev_index: Array | None = None
    decode_only: bool = False  # static: every real sequence has exactly one query row

    @property
    def num_tokens(self) -> int:
        """T, the token bucket (padded rows included)."""
        return self.input_ids.shape[0]


def input_ids(step: StepInput) -> jax.Array:
    """In the program: int32 [T], the step's token ids, those of rows with a prev_index taken
    from prev_sampled (a step dispatched ahead: see the fields)."""
    if step.prev_index is None:
        return step.input_ids
    prev = jax.numpy.concatenate(step.prev_sampled)
    return jax.numpy.where(step.prev_index >= 0, prev[jax.numpy.maximum(step.prev_index, 0)],
                           step.input_ids)


jax.tree_util.register_dataclass(
    StepInput,
    data_fields=[f.name for f in dataclasses.fields(StepInput) if f.name != "decode_only"],
    meta_fields=["decode_only"])
