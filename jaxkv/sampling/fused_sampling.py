"""Fused sampling: the step program samples a plain step's tokens itself.

A step whose sampled rows are all plain (one row per sequence: no draft; no logprobs,
penalties, logits filters, min_tokens ban, bad words or grammar; any temperature, top-k,
top-p, min-p and seed) needs nothing from the sampler but its tokens. Every step program of a
runner without tensor parallelism (`max_tokens`) also takes a SamplingArrays record
(StepInput.sampling, the sampler's per-row parameters, row i = sequence i) and returns the
tokens of each sequence's last row, computed under a `lax.switch` on StepInput.sample_mode:
0 skips the LM head, 1-3 run the sampler's "greedy", "random" or "filtered" mode
(jaxkv/sampling/sampler.py MODES, chosen as the separate sampler chooses them). The step
then runs one program instead of three (the step, the gather of its sampled rows, the
sampler), and the sampled ids are all that comes back; vLLM V1 samples inside its model
runner's step the same way. On the H200 (2026-12-04) each extra program cost a host round
trip (a 1.95 ms median gap before the sampler); on the 2-core CPU each program boundary hands
the work to another thread and restarts the weight stream.

The tokens are the separate sampler's: the same LM head (LlamaModel.logits) on the same rows
and the same sampler.sample with the same arrays (per-request keys: a random row's token does
not depend on the program it runs in).

Multi-step decode's k-step programs (jaxkv/runner/multi_step.py) sample the same way, each
iteration through the step function. Host side (`fusable`, `mode_index`, `spans`,
`with_sampling`): plain data; in the program (`sampled_tokens`): JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.sampling import sampler as smp
from jaxkv.sampling.rows import Span, needs_penalties, sampler_mode, sampling_arrays

NO_LIMIT = 1 << 30  # max_tokens of a runner whose every bucket fuses


def max_tokens(tensor_parallel_size: int) -> int:
    """The largest token bucket whose step program fuses sampling: every bucket (NO_LIMIT)
    on one device, none (0) with tensor parallelism (its sampler keeps the separate
    programs, as the issue of async scheduling lets it)."""
    return NO_LIMIT if tensor_parallel_size <= 1 else 0


def plain(s) -> bool:
    """Whether ScheduledRequest `s` samples one row whose token the sampler's modes give from
    its logits and SamplingArrays alone (no logprobs, drafts, penalties, logits filters,
    bans or grammar)."""
    return (s.sampling_params.logprobs is None and not s.spec_token_ids
            and s.grammar_bitmask is None and not needs_penalties(s))


def fusable(scheduled, num_tokens: int, max_tokens: int) -> bool:
    """Whether a step of `scheduled` (ScheduledRequests) padded to bucket `num_tokens` runs
    its sampling in its own program: the bucket is at most `max_tokens`, some sequence
    samples and every sampling one is plain."""
    sampling = [s for s in scheduled if s.sample]
    return num_tokens <= max_tokens and bool(sampling) and all(map(plain, sampling))


def spans(scheduled) -> list[Span]:
    """The sampled sequences' rows in the fused output: sequence i's token is row i (its
    logits_indices entry), one row each."""
    return [Span(s, i, 1) for i, s in enumerate(scheduled) if s.sample]


def mode_index(spans_: list[Span]) -> np.ndarray:
    """StepInput.sample_mode of a fused step: int32 [1], 1 + the index in sampler.MODES of
    the mode the separate sampler would run for these rows."""
    return mode_of([x.sched.sampling_params for x in spans_])


def mode_of(params) -> np.ndarray:
    """StepInput.sample_mode (int32 [1]) of sampled rows with SamplingParams `params`."""
    return np.array([1 + smp.MODES.index(sampler_mode(params))], np.int32)


def with_sampling(si, spans_: list[Span]):
    """StepInput `si` (a bucket whose program fuses sampling) asking its program to sample
    `spans_` (from `spans`): sample_mode and the sampler's per-row arrays [R] set."""
    return dataclasses.replace(si, sample_mode=mode_index(spans_),
                               sampling=sampling_arrays(spans_, len(si.seq_lens)))


def sampled_tokens(logits_fn, hidden, step, cpu: bool = False):
    """In the step program: int32 [R], the token of each sequence's last row (its
    logits_indices entry): sampler.sample of logits_fn(hidden rows) (float32 [R, V]) with
    step.sampling, in the mode step.sample_mode[0] names (1-3); zeros when it is 0 (the LM
    head is skipped). `cpu`: the greedy argmax by the C++ kernel, as the sampler programs
    of a model with LlamaModel.cpu_matmul."""
    idx = step.logits_indices

    def run(mode):
        return lambda h: smp.sample(logits_fn(h[idx]), step.sampling, None, mode=mode,
                                    num_logprobs=0, cpu=cpu).token_ids

    skip = [lambda h: jnp.zeros(idx.shape, jnp.int32)]
    return jax.lax.switch(step.sample_mode[0], skip + [run(m) for m in smp.MODES], hidden)
