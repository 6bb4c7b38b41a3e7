"""The sampler's rows of one step, on the host (numpy): which hidden rows are sampled, their
per-row sampling and penalty arrays, and the verification of draft tokens.

A sequence that samples gets one row per position it samples: its last position, and with a
draft of d tokens (speculative decoding, jaxkv.core.spec_decode) the d positions before it as
well. Row j of a sequence is sampled exactly as its output token num_output_tokens + j would
be without speculation, had the drafts before it been the output: the same per-request key
(seed, sample index, output position), the same penalties (those drafts counted as output) and
the same min_tokens ban. Drafts are accepted up to the first row whose sampled token differs;
that row's token is kept too (all accepted: the last row's, the "bonus" token).

With a draft proposed deterministically (the n-gram proposer, a one-hot proposal q), this is
the rejection sampling of Leviathan et al. 2023 / Chen et al. 2023 exactly: draft x is accepted
with probability p(x) = min(1, p(x) / q(x)), and when it is not, the kept token follows p
without x, renormalized (their residual max(0, p - q)). Greedy rows accept while the argmax
matches the draft. So the output distribution is the model's, and a seeded request gives the
same tokens with and without speculation (up to the last-bit noise of a different batch shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxkv.sampling import sampler as smp

PENALTY_MIN_WIDTH = 512  # narrowest padded token-id width of the penalty arrays


@dataclass(slots=True)
class Span:
    """One sampling sequence's rows: `sched` (its ScheduledRequest), `row` (its first row in
    the sampler's batch), `count` (1 + its draft tokens)."""
    sched: object
    row: int
    count: int


def layout(scheduled, query_start_loc) -> tuple[list[Span], np.ndarray]:
    """(spans, hidden row indices int32 [n]) of the sequences in `scheduled` that sample:
    each samples the last 1 + len(spec_token_ids) rows of its query (query_start_loc [R + 1])."""
    spans, idx = [], []
    for i, s in enumerate(scheduled):
        if not s.sample:
            continue
        m = 1 + len(s.spec_token_ids)
        end = int(query_start_loc[i + 1])
        spans.append(Span(s, len(idx), m))
        idx.extend(range(end - m, end))
    return spans, np.asarray(idx, np.int32)


def sampling_arrays(spans: list[Span], r: int) -> smp.SamplingArrays:
    """Per-row parameters [r] (rows past the spans are padding)."""
    temp = np.zeros(r, np.float32)
    top_p = np.ones(r, np.float32)
    top_k = np.zeros(r, np.int32)
    min_p = np.zeros(r, np.float32)
    seed = np.zeros(r, np.uint32)
    seed_hi = np.zeros(r, np.uint32)
    idx = np.zeros(r, np.int32)
    step = np.zeros(r, np.int32)
    if all(x.count == 1 and x.row == i for i, x in enumerate(spans)):  # one row each: at once
        n = len(spans)
        ps = [sp_.sched.sampling_params for sp_ in spans]
        temp[:n] = [p.temperature for p in ps]
        top_p[:n] = [p.top_p for p in ps]
        top_k[:n] = [p.top_k for p in ps]
        min_p[:n] = [p.min_p for p in ps]
        seed64 = [sp_.sched.seed & 0xFFFFFFFFFFFFFFFF for sp_ in spans]
        seed[:n] = [x & 0xFFFFFFFF for x in seed64]
        seed_hi[:n] = [x >> 32 for x in seed64]
        idx[:n] = [sp_.sched.sample_index for sp_ in spans]
        step[:n] = [sp_.sched.num_output_tokens for sp_ in spans]
        return smp.SamplingArrays(temp, top_p, top_k, min_p, seed, idx, step, seed_hi)
    for sp_ in spans:
        s, rows = sp_.sched, slice(sp_.row, sp_.row + sp_.count)
        p = s.sampling_params
        temp[rows], top_p[rows], top_k[rows], min_p[rows] = p.temperature, p.top_p, p.top_k, p.min_p
        seed64 = s.seed & 0xFFFFFFFFFFFFFFFF  # 64-bit two's complement: -1 and 2**64-1 agree
        seed[rows], seed_hi[rows] = seed64 & 0xFFFFFFFF, seed64 >> 32
        idx[rows] = s.sample_index
        step[rows] = s.num_output_tokens + np.arange(sp_.count)  # the output position
    return smp.SamplingArrays(temp, top_p, top_k, min_p, seed, idx, step, seed_hi)


def penalty_arrays(spans: list[Span], r: int, vocab_size: int, max_model_len: int,
                   pending: bool = False) -> smp.PenaltyArrays:
    """Penalty parameters [r], token ids [r, W] (padded with vocab_size, which the sampler's
    scatters drop), bans, logit_bias and allowed_token_ids per row. W holds the step's longest
    prompt or output (drafts included): 512, then x8 (4096, ...), capped at max_model_len; the
    other widths are 8, 64, 512, ... Each width is a sampler program, so they are few.
    `pending`: the spans are a step run ahead (one row each, no bad words), whose last output
    token (of num_output_tokens) is not on the host yet: each row's output ids are the others,
    that column left as padding for the device to fill (pending_fill, sampler.with_pending)."""
    v = vocab_size
    rep = np.ones(r, np.float32)
    pres = np.zeros(r, np.float32)
    freq = np.zeros(r, np.float32)
    longest = max((max(len(sp_.sched.prompt_token_ids),
                       sp_.sched.num_output_tokens if pending else
                       len(sp_.sched.output_token_ids) + sp_.count - 1)
                   for sp_ in spans if sp_.sched.prompt_token_ids is not None), default=0)
    width = min(max_model_len, _width(longest, PENALTY_MIN_WIDTH))
    prompt = np.full((r, width), v, np.int32)
    output = np.full((r, width), v, np.int32)
    bans = [[] for _ in range(r)]
    bias = [{} for _ in range(r)]
    allowed = [[] for _ in range(r)]
    for sp_ in spans:
        s, p = sp_.sched, sp_.sched.sampling_params
        words = s.bad_words_token_ids
        for j in range(sp_.count):
            i = sp_.row + j
            rep[i], pres[i], freq[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            out_ids = None
            assert not (pending and words), "bad_words read the pending token: never run ahead"
            if s.prompt_token_ids is not None:
                out_ids = (s.output_token_ids[:s.num_output_tokens - 1] if pending
                           else list(s.output_token_ids) + s.spec_token_ids[:j])
                prompt[i, :len(s.prompt_token_ids)] = s.prompt_token_ids
                output[i, :len(out_ids)] = out_ids
            # The min_tokens ban (the scheduler lists the ids while too few outputs exist).
            if s.num_output_tokens + j < p.min_tokens:
                bans[i] += s.min_tokens_banned_ids
            bans[i] += bad_word_bans(words, out_ids or [])
            bias[i] = p.logit_bias or {}
            allowed[i] = p.allowed_token_ids or []
    banned = _padded(bans, v, np.int32)
    bias_ids = _padded([list(b) for b in bias], v, np.int32)
    bias_values = _padded([list(b.values()) for b in bias], 0.0, np.float32)
    allowed_ids = _padded(allowed, v, np.int32)
    has_allowed = np.array([bool(a) for a in allowed], bool)
    return smp.PenaltyArrays(rep, pres, freq, prompt, output, banned, bias_ids, bias_values,
                             allowed_ids, has_allowed)


def penalty_padding(vocab_size: int) -> tuple:
    """The value of each PenaltyArrays field in a padding row (penalty_arrays' fills)."""
    v = vocab_size
    return (1.0, 0.0, 0.0, v, v, v, v, 0.0, v, False)


def pending_fill(spans: list[Span], r: int, width: int, sources) -> tuple[np.ndarray, np.ndarray]:
    """For sampler.with_pending, of a step run ahead (penalty_arrays' pending): (sources
    int32 [r]: span i's row takes its token from index sources[i] of the step before's sampled
    tokens; columns int32 [r]: the column of that token in the row's output ids, num_output_tokens
    - 1, or `width` (nothing written) for a row without history or a padding row)."""
    src = np.zeros(r, np.int32)
    col = np.full(r, width, np.int32)
    for x, i in zip(spans, sources):
        src[x.row] = i
        if x.sched.output_token_ids is not None:
            col[x.row] = x.sched.num_output_tokens - 1
    return src, col


def grammar_bitmask(spans: list[Span], r: int, vocab_size: int) -> np.ndarray | None:
    """Structured outputs: int32 [r, ceil(vocab_size / 32)], each constrained row's allowed
    tokens and every bit set elsewhere; None when no row of the step is constrained."""
    masks = [(x.row, x.sched.grammar_bitmask) for x in spans if x.sched.grammar_bitmask is not None]
    if not masks:
        return None
    out = np.full((r, -(-vocab_size // 32)), -1, np.int32)
    for row, m in masks:
        out[row] = m
    return out


def bad_word_bans(words: list[list[int]], output_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output (vLLM's rule: a
    one-token word is always banned)."""
    out = []
    for w in words:
        head = w[:-1]
        if not head or output_ids[len(output_ids) - len(head):] == head:
            out.append(w[-1])
    return out


def _padded(lists, fill, dtype) -> np.ndarray:
    """[len(lists), W], each list left-aligned, `fill` after; W = 8, 64, 512, ... (the first
    holding the longest): each width is a sampler program compiled on first use, so few."""
    a = np.full((len(lists), _width(max(map(len, lists), default=0), 8)), fill, dtype)
    for i, x in enumerate(lists):
        a[i, :len(x)] = x
    return a


def _width(n: int, smallest: int) -> int:
    """The first of smallest, smallest * 8, smallest * 64, ... holding n."""
    width = smallest
    while width < n:
        width *= 8
    return width


def sampler_mode(params) -> str:
    """The sampler mode (sampler.MODES) of rows with SamplingParams `params`: "greedy" when
    every row is greedy, "filtered" when a random row asks for top-k or top-p, else
    "random"."""
    if all(p.temperature < smp.GREEDY_EPS for p in params):
        return "greedy"
    filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in params if p.temperature >= smp.GREEDY_EPS)
    return "filtered" if filtered else "random"


def needs_penalties(s) -> bool:
    """Penalties, the min_tokens ban (the scheduler lists the banned stop ids only while
    fewer than min_tokens outputs exist, as vLLM's MinTokensLogitsProcessor), logit_bias,
    allowed_token_ids or bad_words."""
    p = s.sampling_params
    return p.has_penalties or bool(s.min_tokens_banned_ids) or p.has_logits_filters


def num_accepted(sampled, draft) -> int:
    """Drafts accepted: the leading draft tokens equal to the tokens sampled at their rows."""
    a = 0
    while a < len(draft) and int(sampled[a]) == draft[a]:
        a += 1
    return a
