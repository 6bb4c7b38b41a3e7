"""Padding sizes that bound the number of compiled programs.

Token rows are padded to a bucket from a short list (jaxkv.engine_config.default_token_buckets:
powers of 2 below max_num_batched_tokens, then the budget; of those, the runner picks among the
buckets compiled so far, see jaxkv/runner/compiler.py); sampling rows to
min(token bucket, max_num_seqs). The block-table
width is fixed at the most blocks a max_model_len sequence needs: attention visits the context
in chunks with a trip count set by the longest context of the step (see
jaxkv/attention/xla_ragged.py and the kernels' grids), so short contexts never pay for max_model_len and the width
costs no extra programs.
"""

from __future__ import annotations

import bisect


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n. ValueError if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def num_rows(token_bucket: int, max_num_seqs: int) -> int:
    """Sampling rows for a token bucket: each sequence has at least one token in the step."""
    return min(token_bucket, max_num_seqs)


def sample_rows(t: int, n: int, max_num_seqs: int) -> int:
    """Sampler rows of a token-bucket-t step that samples n rows: min(t, max_num_seqs),
    every sequence's last row; more only with draft rows (speculative decoding): the next
    power of two, at most t."""
    r = num_rows(t, max_num_seqs)
    return r if n <= r else min(t, pow2_at_least(n, 1))


def sample_row_counts(t: int, max_num_seqs: int, num_speculative_tokens: int) -> tuple[int, ...]:
    """Every sampler row count a token-bucket-t step can use (compiled with the bucket)."""
    most = min(t, max_num_seqs * (1 + num_speculative_tokens))
    return tuple(sorted({sample_rows(t, n, max_num_seqs) for n in (0, *range(1, most + 1))}))


def pow2_at_least(n: int, smallest: int = 8) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b
