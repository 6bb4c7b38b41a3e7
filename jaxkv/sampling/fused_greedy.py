"""Fused greedy sampling: the smallest buckets' step programs also take the argmax themselves.

A step whose sampled rows are all plain greedy (temperature below GREEDY_EPS, one row per
sequence, no logprobs, penalties, logits filters, min_tokens ban, bad words, drafts or
grammar) needs nothing from the sampler but argmax(logits) of each sequence's last row. In
the step programs of the token buckets of at most `max_tokens` rows (the runner's
`fused_greedy_max_tokens`: on the cpu backend with a tied embedding, the buckets whose LM
head is the C++ kernel's read of the embedding table, jaxkv.cpu_kernels.linear's
MAX_ROWS_TRANSPOSED; 0 otherwise) that argmax is a third output, computed under a `lax.cond` on
StepInput.fuse_greedy, so a step that does not ask for it skips the LM head. A single greedy
stream then runs one program per token instead of three (the step, the gather of its
sampled rows, the sampler): on the 2-core CPU that saved ~2-3 ms of ~25 per token (each
program boundary hands the work to another thread and restarts the weight stream) and ~1
ms of host work. The tokens are the sampler's greedy ones exactly: the same LM head
(LlamaModel.logits) on the same rows, then the same argmax (sampler.argmax_tokens).

Host side (`fusable`, `spans`): plain data; in the program (`greedy_tokens`): JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cpu_kernels import linear as cpu_linear
from jaxkv.sampling import sampler as smp
from jaxkv.sampling.rows import Span, needs_penalties

ON = np.ones(1, np.int32)  # StepInput.fuse_greedy of a step that asks for the argmax


def max_tokens(model) -> int:
    """The largest token bucket whose step program fuses greedy sampling for LlamaModel
    `model`: cpu_linear.MAX_ROWS_TRANSPOSED where its LM head is the C++ kernel's read of
    the tied embedding table (the same in the step as in the sampler); 0 (none) otherwise."""
    return cpu_linear.MAX_ROWS_TRANSPOSED if model.cpu_matmul and model.cfg.tie_word_embeddings else 0


def plain_greedy(s) -> bool:
    """Whether ScheduledRequest `s` samples one row whose token is its logits' argmax and
    nothing else (no logprobs, drafts, penalties, logits filters, bans or grammar)."""
    p = s.sampling_params
    return (p.temperature < smp.GREEDY_EPS and p.logprobs is None and not s.spec_token_ids
            and s.grammar_bitmask is None and not needs_penalties(s))


def fusable(scheduled, num_tokens: int, max_tokens: int) -> bool:
    """Whether a step of `scheduled` (ScheduledRequests) padded to bucket `num_tokens` runs
    its greedy sampling in its own program: the bucket is at most `max_tokens`, some
    sequence samples and every sampling one is plain greedy."""
    sampling = [s for s in scheduled if s.sample]
    return num_tokens <= max_tokens and bool(sampling) and all(map(plain_greedy, sampling))


def spans(scheduled) -> list[Span]:
    """The sampled sequences' rows in the fused output: sequence i's token is row i (its
    logits_indices entry), one row each."""
    return [Span(s, i, 1) for i, s in enumerate(scheduled) if s.sample]


def greedy_tokens(logits_fn, hidden, step):
    """In the step program: int32 [R], the argmax of logits_fn(hidden[logits_indices]) (float32
    [R, V]) when step.fuse_greedy[0] is 1, else zeros (the LM head is skipped)."""
    idx = step.logits_indices
    return jax.lax.cond(
        step.fuse_greedy[0] > 0,
        lambda h: smp.argmax_tokens(logits_fn(h[idx])),
        lambda h: jnp.zeros(idx.shape, jnp.int32), hidden)
