"""Padding sizes that bound the number of compiled programs.

Token rows are padded to a bucket from a short list (powers of two up to
max_num_batched_tokens); sampling rows to min(token bucket, max_num_seqs). The block-table
width is fixed at the most blocks a max_model_len sequence needs: attention visits the context
in chunks with a trip count set by the longest context of the step (see
pallas_kernels/reference.py), so short contexts never pay for max_model_len and the width
costs no extra programs.
"""

from __future__ import annotations

import bisect


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of 8 below the budget, then the budget: (1, 8, 64, 512) for 512 tokens.

    Each bucket is one compiled program of ~8 s on the 2-core CPU (30 unrolled layers), and
    the start-up warmup must stay under a minute, so the list is short. It still fits the
    common steps: 1 is a lone decode (bound by reading the weights, so padding it to 8 rows
    would cost ~1.5x), 8 and 64 are decode batches (64 = max_num_seqs), and steps that carry
    a prefill chunk fill the whole budget anyway.
    """
    out, b = [], 1
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 8
    out.append(max_num_batched_tokens)
    return tuple(out)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """Smallest bucket >= n. ValueError if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def num_rows(token_bucket: int, max_num_seqs: int) -> int:
    """Sampling rows for a token bucket: each sequence has at least one token in the step."""
    return min(token_bucket, max_num_seqs)


def pow2_at_least(n: int, smallest: int = 8) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b
