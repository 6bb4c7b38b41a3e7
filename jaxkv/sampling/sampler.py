"""On-device sampling: temperature, top-k, top-p, min-p, penalties, per-request seeds, logprobs.

Semantics follow vLLM's V1 Sampler: allowed_token_ids, the bans (bad words, min_tokens),
logit_bias and the penalties (repetition on prompt+output tokens, then frequency and presence
on output tokens) apply to the logits first;
greedy rows take the argmax; random rows divide by temperature, apply min-p, top-k and top-p,
and draw from what is left. Returned logprobs are the raw model log-probabilities (before
penalties and temperature), as vLLM's default logprobs mode.

Penalty counts are computed on device from token ids the host passes in the step input
(prompt ids and output ids, [rows, W] padded with vocab_size, which the scatter drops; W is
a width holding the step's longest prompt or output: 512, 4096, ... or max_model_len);
nothing about a request is kept in device state between steps.

Randomness: the exponential race (as vLLM samples; it draws exactly from p), run in two
stages so that a row draws ~450 exponentials instead of one per vocabulary entry: the
vocabulary is cut into groups of RACE_GROUP tokens; a race over the groups' masses (the
largest mass_j / E_j) picks a group, then a race inside it (the largest p_i / E_i) picks the
token. P(group j) = mass_j / sum(p) and P(i | j) = p_i / mass_j, so P(i) = p_i / sum(p), exact.
Row r's noise comes from its own key, fold_in(fold_in(PRNGKey(seed_r), sample_index_r),
num_output_tokens_r). A row's token is then a function of its own logits, parameters, seed and
position only: the same alone or next to any other rows, whatever mode the step runs in, and
robust to the last-bit noise that a different batch shape puts on the logits (a flip needs two
candidates whose ratios agree to that noise, where an inverted CDF over 49k tokens flips
whenever a draw lands on any rare token). On the 2-core CPU the one-stage race spent ~58 ms of
a 64-row sampling call drawing 3.1M exponentials; two stages draw 29k.
Modes only decide how much work a step does: a batch of only greedy rows never builds
probabilities ("greedy"); top-k and top-p need a sort per row, done only when some row of the
step asks for them ("filtered"); a row without them keeps exactly the same probabilities in
"random" and "filtered" mode.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxkv.cpu_kernels import argmax as cpu_argmax

GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
MODES = ("greedy", "random", "filtered")


class SamplingArrays(NamedTuple):
    """Per-row parameters, each [R] unless noted."""
    temperature: jax.Array    # float32
    top_p: jax.Array          # float32, 1 = off
    top_k: jax.Array          # int32, 0 = off
    min_p: jax.Array          # float32, 0 = off
    seed: jax.Array           # uint32
    sample_index: jax.Array   # int32 (child j of an n > 1 request)
    step: jax.Array           # int32 (output tokens so far)
    seed_hi: jax.Array | None = None  # uint32: bits 32-63 of the seed (two's complement)


class PenaltyArrays(NamedTuple):
    repetition: jax.Array     # float32 [R], 1 = off
    presence: jax.Array       # float32 [R]
    frequency: jax.Array      # float32 [R]
    prompt_ids: jax.Array     # int32 [R, W], padded with vocab_size (W: 512 x 8^k or L)
    output_ids: jax.Array     # int32 [R, W], padded with vocab_size
    banned_ids: jax.Array     # int32 [R, K], padded with vocab_size (min_tokens ban, bad words)
    bias_ids: jax.Array       # int32 [R, KB], padded with vocab_size (logit_bias keys)
    bias_values: jax.Array    # float32 [R, KB]
    allowed_ids: jax.Array    # int32 [R, KA], padded with vocab_size (allowed_token_ids)
    has_allowed: jax.Array    # bool [R]: the row samples only among its allowed_ids


def with_pending(p: PenaltyArrays, prev0: jax.Array, prev1: jax.Array, source: jax.Array,
                 column: jax.Array) -> PenaltyArrays:
    """`p` with the output token each row sampled in the step before, still on the device,
    written into its output_ids (async scheduling's step run ahead, jaxkv/runner/lookahead.py:
    the host does not know that token yet). prev0, prev1: int32 [P] sampled tokens of the
    step before (its one or two sampler outputs); source int32 [R]: each row's index in the
    two concatenated; column int32 [R]: where it goes in the row (W or more: a row without
    history, nothing written)."""
    tok = jnp.concatenate([prev0, prev1])[source]
    rows = jnp.arange(tok.shape[0])
    return PenaltyArrays(*p[:4], p.output_ids.at[rows, column].set(tok, mode="drop"), *p[5:])


def pad_rows(tokens: jax.Array, n: int) -> jax.Array:
    """int32 tokens [R] padded with zeros to [n] when R < n (else as they are)."""
    return jnp.pad(tokens.astype(jnp.int32), (0, max(n - tokens.shape[0], 0)))


class SamplerOutput(NamedTuple):
    token_ids: jax.Array          # int32 [R]
    logprob: jax.Array            # float32 [R]: raw logprob of the sampled token (if asked)
    rank: jax.Array               # int32 [R]: its 1-based rank in the vocabulary (if asked)
    top_logprobs: jax.Array       # float32 [R, k]
    top_ids: jax.Array            # int32 [R, k]


def apply_penalties(logits, p: PenaltyArrays):
    """In vLLM V1's order: allowed_token_ids, bans (bad words, min_tokens), logit_bias, then
    repetition / frequency / presence penalties."""
    r, v = logits.shape
    rows = jnp.arange(r)[:, None]
    allowed = jnp.zeros((r, v), bool).at[rows, p.allowed_ids].set(True, mode="drop")
    logits = jnp.where(p.has_allowed[:, None] & ~allowed, -jnp.inf, logits)
    logits = logits.at[rows, p.banned_ids].set(-jnp.inf, mode="drop")
    logits = logits.at[rows, p.bias_ids].add(p.bias_values, mode="drop")
    out_counts = jnp.zeros((r, v), jnp.float32).at[rows, p.output_ids].add(1.0, mode="drop")
    seen = jnp.zeros((r, v), bool).at[rows, p.prompt_ids].set(True, mode="drop") | (out_counts > 0)
    rep = p.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - p.frequency[:, None] * out_counts - p.presence[:, None] * (out_counts > 0)


RACE_GROUP = 256  # tokens per group of the two-stage race (49152 tokens: 192 groups)


def _row_keys(s: SamplingArrays):
    """One PRNG key per row from (seed, seed_hi, sample_index, step)."""
    hi = s.seed_hi if s.seed_hi is not None else jnp.zeros_like(s.seed)

    def one(seed, seed_hi, j, step):
        key = jax.random.PRNGKey(seed)
        # Seeds below 2**32 keep their stream; higher bits (and negative seeds) fold in.
        key = jnp.where(seed_hi != 0, jax.random.fold_in(key, seed_hi), key)
        return jax.random.fold_in(jax.random.fold_in(key, j), step)
    return jax.vmap(one)(s.seed, hi, s.sample_index, s.step)


def _exponentials(keys, stage: int, n: int):
    """Exp(1) noise [R, n] float32 for stage 0 (groups) or 1 (tokens of the chosen group)."""
    draw = lambda k: jax.random.exponential(jax.random.fold_in(k, stage), (n,), jnp.float32)  # noqa: E731
    # A zero draw would make 0 / 0 for a filtered token; the floor keeps those at 0.
    return jnp.maximum(jax.vmap(draw)(keys), 1e-30)


def race(probs, s: SamplingArrays, group: int = RACE_GROUP):
    """Draw one token per row from unnormalized probs float32 [R, V] (zeros never win) by the
    two-stage exponential race described above -> int32 [R]."""
    r, v = probs.shape
    group = min(group, v)
    ng = -(-v // group)
    g = jnp.pad(probs, ((0, 0), (0, ng * group - v))).reshape(r, ng, group)
    keys = _row_keys(s)
    j = jnp.argmax(jnp.sum(g, axis=-1) / _exponentials(keys, 0, ng), axis=-1)
    inside = jnp.take_along_axis(g, j[:, None, None], axis=1)[:, 0]  # [R, group]
    i = jnp.argmax(inside / _exponentials(keys, 1, group), axis=-1)
    return (j * group + i).astype(jnp.int32)


def _top_k_top_p_mask(probs, top_k, top_p):
    """Which tokens top-k, then top-p (on what top-k keeps) leave in, in vocabulary order.

    probs float32 [R, V]; top_k int32 [R] (0 = off); top_p float32 [R] (1 = off) -> bool
    [R, V]. A row with both off keeps every token, so its probabilities are bit-identical to
    the unfiltered path. Ties are ranked by token id (stable sort), as the row's own data
    decides. Semantics as vLLM's top-k/top-p sampler (top-p keeps the smallest prefix of the
    sorted tokens whose mass reaches p, and always the most likely token).
    """
    r, v = probs.shape
    order = jnp.argsort(-probs, axis=-1, stable=True)
    ps = jnp.take_along_axis(probs, order, axis=-1)
    rank = jnp.arange(v)[None]
    k = jnp.where(top_k > 0, top_k, v)[:, None]
    ps = jnp.where(rank < k, ps, 0.0)
    before = jnp.cumsum(ps, axis=-1) - ps  # mass strictly before this token
    in_p = (before < top_p[:, None] * jnp.sum(ps, -1, keepdims=True)) | (rank == 0)
    keep_sorted = (rank < k) & (in_p | (top_p[:, None] >= 1.0))
    return jnp.zeros((r, v), bool).at[jnp.arange(r)[:, None], order].set(keep_sorted)


def apply_bitmask(logits, bitmask):
    """Structured outputs: logits float32 [R, V] with every token whose bit is clear in
    bitmask int32 [R, ceil(V / 32)] (bit t % 32 of word t // 32, as llguidance and vLLM pack
    it) set to -inf."""
    ids = jnp.arange(logits.shape[-1])
    words = bitmask[:, ids // 32]
    allowed = (jax.lax.shift_right_logical(words, (ids % 32).astype(jnp.int32)[None]) & 1) == 1
    return jnp.where(allowed, logits, -jnp.inf)


def argmax_tokens(logits, *, cpu: bool = False):
    """int32 [R]: each row's argmax of logits float32 [R, V], the token of a greedy row; the
    fused sampling of the step programs runs this sampler too (jaxkv/sampling/fused_sampling.py).

    jnp.argmax's result exactly (the first index on ties, -0.0 equal to 0.0; a NaN counts as
    the largest, the first NaN wins), computed as two integer reductions: each logit as an
    int32 key in the floats' order (NaN above +inf), the row's largest key, then the first
    index holding it. XLA:CPU runs jnp.argmax as one (value, index) reduction that does not
    vectorize: 4.8 ms for 64 x 49152 logits on the 2-core Xeon. (A float max is no shortcut:
    XLA:CPU's vectorized max drops NaNs in rows of 4096 or more.) With `cpu` (the sampler
    programs of a model with LlamaModel.cpu_matmul: the cpu backend, float32 weights, one
    device) the same keys in one pass, per row, by jaxkv's C++ kernel
    (jaxkv.cpu_kernels.argmax, argmax.cc): 2.4-3.7 -> ~0.4 ms at 64 x 49152. Raises
    RuntimeError if that kernel is asked for and cannot be built."""
    if cpu:
        return cpu_argmax.argmax(logits)
    x = jnp.where(logits == 0, jnp.zeros_like(logits), logits)  # -0.0 -> 0.0
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # negatives: order reversed
    key = jnp.where(jnp.isnan(x), jnp.int32(0x7FFFFFFF), key)
    top = jnp.max(key, axis=-1, keepdims=True)
    v = logits.shape[-1]
    return jnp.min(jnp.where(key == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def sample(logits, s: SamplingArrays, penalties: PenaltyArrays | None, bitmask=None, *,
           mode: str, num_logprobs: int, cpu: bool = False) -> SamplerOutput:
    """logits float32 [R, V] -> SamplerOutput. bitmask: structured outputs' allowed tokens,
    int32 [R, ceil(V / 32)] or None (applied first, as vLLM applies the grammar before its
    sampler; logprobs stay the model's own, unmasked). mode in MODES (static); num_logprobs
    static (0 = no logprobs; else top-k width); cpu (static): greedy rows' argmax by the C++
    kernel (argmax_tokens)."""
    raw = logits
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    if penalties is not None:
        logits = apply_penalties(logits, penalties)
    tokens = argmax_tokens(logits, cpu=cpu)
    if mode != "greedy":
        greedy = s.temperature < GREEDY_EPS
        t = jnp.where(greedy, 1.0, s.temperature)[:, None]
        probs = jax.nn.softmax(logits / t, axis=-1)
        probs = jnp.where(probs >= s.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)
        if mode == "filtered":
            probs = jnp.where(_top_k_top_p_mask(probs, s.top_k, s.top_p), probs, 0.0)
        tokens = jnp.where(greedy, tokens, race(probs, s))
    r = logits.shape[0]
    if num_logprobs:
        lp = jax.nn.log_softmax(raw, axis=-1)
        chosen = jnp.take_along_axis(lp, tokens[:, None], -1)[:, 0]
        rank = jnp.sum(lp >= chosen[:, None], axis=-1).astype(jnp.int32)  # as vLLM
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
        return SamplerOutput(tokens, chosen, rank, top_lp, top_ids.astype(jnp.int32))
    z = jnp.zeros((r,), jnp.float32)
    return SamplerOutput(tokens, z, z.astype(jnp.int32), jnp.zeros((r, 0), jnp.float32),
                         jnp.zeros((r, 0), jnp.int32))


def prompt_logprobs(logits, targets, *, num_logprobs: int):
    """logits float32 [T, V], targets int32 [T] (the next prompt token of each row) ->
    (target logprob [T], target rank [T], top logprobs [T, k], top ids [T, k])."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, targets[:, None], -1)[:, 0]
    rank = jnp.sum(lp >= chosen[:, None], axis=-1).astype(jnp.int32)  # as vLLM
    top_lp, top_ids = jax.lax.top_k(lp, max(num_logprobs, 1))
    return chosen, rank, top_lp[:, :num_logprobs], top_ids[:, :num_logprobs].astype(jnp.int32)
