"""The on-device sampler on small logits: penalties against a numpy reference, filtering,
seeds, and logprob ranks."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.sampling import sampler as smp

V = 12


def arrays(r, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seeds=None, step=0):
    f = lambda x, dt=np.float32: np.full(r, x, dt)  # noqa: E731
    return smp.SamplingArrays(f(temperature), f(top_p), f(top_k, np.int32), f(min_p),
                              np.asarray(seeds if seeds is not None else np.arange(r), np.uint32),
                              np.zeros(r, np.int32), f(step, np.int32))


def test_penalties_match_vllm_formulas():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, V)).astype(np.float32) * 3
    prompt = np.full((2, 6), V, np.int32)
    prompt[0, :3] = [1, 2, 2]
    output = np.full((2, 6), V, np.int32)
    output[0, :4] = [2, 5, 5, 5]
    output[1, :1] = [7]
    banned = np.full((2, 8), V, np.int32)
    banned[1, 0] = 3
    bias_ids = np.full((2, 8), V, np.int32)
    bias_ids[0, :2] = [5, 9]
    bias_values = np.zeros((2, 8), np.float32)
    bias_values[0, :2] = [1.5, -2.0]
    allowed = np.full((2, 8), V, np.int32)
    allowed[1, :3] = [3, 7, 9]
    pen = smp.PenaltyArrays(np.array([1.3, 1.0], np.float32), np.array([0.5, 0.2], np.float32),
                            np.array([0.25, 0.0], np.float32), prompt, output, banned,
                            bias_ids, bias_values, allowed, np.array([False, True]))
    got = np.asarray(smp.apply_penalties(jnp.asarray(logits), pen))
    want = logits.copy()
    # vLLM V1's order: allowed_token_ids, bans, logit_bias, then the penalties.
    want[1, [t for t in range(V) if t not in (3, 7, 9)]] = -np.inf
    want[0, 5] += 1.5
    want[0, 9] -= 2.0
    for t in (1, 2, 5):  # repetition: tokens seen in prompt or output
        want[0, t] = want[0, t] / 1.3 if want[0, t] > 0 else want[0, t] * 1.3
    counts = {2: 1, 5: 3}
    for t, c in counts.items():
        want[0, t] -= 0.25 * c + 0.5
    want[1, 7] -= 0.2
    want[1, 3] = -np.inf
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_greedy_rows_and_top_k_filtering():
    logits = jnp.asarray(np.tile(np.arange(V, dtype=np.float32), (64, 1)))
    out = smp.sample(logits, arrays(64, temperature=0.0), None, mode="greedy", num_logprobs=0)
    assert np.all(np.asarray(out.token_ids) == V - 1)
    out = smp.sample(logits, arrays(64, temperature=5.0, top_k=2), None, mode="filtered", num_logprobs=0)
    assert set(np.asarray(out.token_ids).tolist()) == {V - 1, V - 2}
    flat = jnp.zeros((64, V))  # uniform: top_p=0.25 keeps the first 3 of 12 sorted tokens
    out = smp.sample(flat, arrays(64, top_p=0.25), None, mode="filtered", num_logprobs=0)
    assert len(set(np.asarray(out.token_ids).tolist())) <= 3
    out = smp.sample(logits, arrays(64, temperature=1.0, min_p=0.3), None, mode="random", num_logprobs=0)
    assert set(np.asarray(out.token_ids).tolist()) <= {V - 1, V - 2}  # e^-1 > 0.3 > e^-2


def test_seeds_are_per_row_and_reproducible():
    logits = jnp.zeros((8, V))
    a = smp.sample(logits, arrays(8, seeds=[5] * 8), None, mode="random", num_logprobs=0).token_ids
    assert len(set(np.asarray(a).tolist())) == 1  # same seed, same index, same step: same draw
    b = smp.sample(logits[:1], arrays(1, seeds=[5]), None, mode="random", num_logprobs=0).token_ids
    assert int(b[0]) == int(a[0])
    c = smp.sample(logits, arrays(8, seeds=range(8)), None, mode="random", num_logprobs=0).token_ids
    assert len(set(np.asarray(c).tolist())) > 1


def test_logprobs_are_raw_and_ranked():
    logits = jnp.asarray(np.array([[0.0, 2.0, 1.0, -1.0] + [-5.0] * (V - 4)], np.float32))
    out = smp.sample(logits, arrays(1, temperature=0.0), None, mode="greedy", num_logprobs=3)
    lp = np.asarray(jnp.log(jnp.exp(logits) / jnp.sum(jnp.exp(logits))))[0]
    assert int(out.token_ids[0]) == 1 and int(out.rank[0]) == 1
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0]), lp[[1, 2, 0]], rtol=1e-5)
    assert np.asarray(out.top_ids[0]).tolist() == [1, 2, 0]


def test_a_row_draws_the_same_token_in_every_mode_and_batch():
    # Case C1's kind: a row's token depends on its own logits, parameters, seed and step only,
    # never on the mode its neighbours force or on where it sits in the batch.
    rng = np.random.default_rng(1)
    row = rng.standard_normal(V).astype(np.float32) * 2
    for seed in range(50):
        alone = smp.sample(jnp.asarray(row[None]), arrays(1, seeds=[seed], step=seed % 4), None,
                           mode="random", num_logprobs=0).token_ids[0]
        r = 4
        logits = np.tile(row, (r, 1))
        logits[1:] += rng.standard_normal((r - 1, V)).astype(np.float32)
        s = arrays(r, seeds=[seed, 1, 2, 3], step=seed % 4)
        s = s._replace(top_k=np.array([0, 3, 0, 1], np.int32), top_p=np.array([1, 1, .5, 1], np.float32),
                       temperature=np.array([1, 1, 1, 0], np.float32))
        filtered = smp.sample(jnp.asarray(logits), s, None, mode="filtered", num_logprobs=2).token_ids[0]
        assert int(filtered) == int(alone), seed


def test_top_k_and_top_p_keep_the_right_tokens_in_vocabulary_order():
    probs = jnp.asarray(np.array([[0.1, 0.4, 0.2, 0.3] + [0.0] * (V - 4)] * 3, np.float32))
    keep = np.asarray(smp._top_k_top_p_mask(probs, np.array([2, 0, 0], np.int32),
                                            np.array([1.0, 0.6, 1.0], np.float32)))
    assert keep[0, :4].tolist() == [False, True, False, True]  # top-2: 0.4 and 0.3
    assert keep[1, :4].tolist() == [False, True, False, True]  # 0.4 + 0.3 reaches 0.6
    assert keep[2].all()  # both off: every token stays, so probabilities are untouched


def test_every_bit_of_a_64_bit_seed_counts():
    logits = jnp.zeros((16, V))
    lo = np.full(16, 1, np.uint32)

    def draw(hi):
        s = arrays(16, seeds=lo, step=0)._replace(sample_index=np.arange(16, dtype=np.int32),
                                                  seed_hi=np.full(16, hi, np.uint32))
        return np.asarray(smp.sample(logits, s, None, mode="random", num_logprobs=0).token_ids)
    plain = np.asarray(smp.sample(logits, arrays(16, seeds=lo)._replace(
        sample_index=np.arange(16, dtype=np.int32)), None, mode="random", num_logprobs=0).token_ids)
    assert (draw(0) == plain).all()          # seeds below 2**32 keep their stream
    assert (draw(1) != plain).any()          # seed 2**32 + 1 is not seed 1


def test_seed_must_fit_in_64_bits():
    import pytest

    from jaxkv import SamplingParams
    SamplingParams(seed=-1)
    SamplingParams(seed=2**64 - 1)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)


def test_the_exponential_race_draws_from_the_distribution():
    # 4000 rows with their own seeds over one 12-token distribution: frequencies match p.
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05, 0.03, 0.02, 0.005, 0.004, 0.001])
    r = 4000
    logits = jnp.asarray(np.tile(np.log(p).astype(np.float32), (r, 1)))
    tokens = np.asarray(smp.sample(logits, arrays(r, seeds=np.arange(r)), None, mode="random",
                                   num_logprobs=0).token_ids)
    freq = np.bincount(tokens, minlength=V) / r
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / r) + 1e-3), freq


def test_the_two_stage_race_is_exact_across_groups():
    # 40 tokens in groups of 8 (5 groups): unnormalized
    # weights with zeros; every token's frequency matches p / sum(p) and zeros never win.
    rng = np.random.default_rng(1)
    w = rng.random(40) ** 3
    w[[3, 17, 18, 39]] = 0.0
    p = w / w.sum()
    r = 12000
    probs = jnp.asarray(np.tile(w.astype(np.float32), (r, 1)))
    tokens = np.asarray(smp.race(probs, arrays(r, seeds=np.arange(r)), group=8))
    freq = np.bincount(tokens, minlength=40) / r
    assert np.all(freq[w == 0] == 0)
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / r) + 1e-3), (freq, p)
    # a vocabulary that does not divide into groups: the padding never wins either
    t2 = np.asarray(smp.race(probs[:, :37], arrays(r, seeds=np.arange(r)), group=8))
    assert t2.max() < 37 and np.all(np.bincount(t2, minlength=37)[w[:37] == 0] == 0)


def test_sample_draws_from_the_distribution_over_many_groups():
    # A 600-token vocabulary (3 groups of 256, the last partly padding) through sample():
    # frequencies of the kept tokens match softmax(logits / T); top-k drops the rest.
    rng = np.random.default_rng(2)
    logits = np.full(600, -30.0, np.float32)
    hot = np.array([3, 250, 256, 300, 511, 512, 599])
    logits[hot] = rng.normal(0, 1, len(hot)).astype(np.float32)
    r = 8000
    x = jnp.asarray(np.tile(logits, (r, 1)))
    tokens = np.asarray(smp.sample(x, arrays(r, temperature=0.7, seeds=np.arange(r)), None,
                                   mode="random", num_logprobs=0).token_ids)
    p = np.exp(logits / 0.7 - (logits / 0.7).max())
    p /= p.sum()
    freq = np.bincount(tokens, minlength=600) / r
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / r) + 1e-3)
    kept = np.asarray(smp.sample(x, arrays(r, top_k=3, seeds=np.arange(r)), None,
                                 mode="filtered", num_logprobs=0).token_ids)
    assert set(kept.tolist()) <= set(np.argsort(-logits)[:3].tolist())


def test_grammar_bitmask_keeps_exactly_the_set_bits():
    """llguidance's packing (bit t % 32 of word t // 32, sign bit included); a vocabulary that
    is not a multiple of 32; greedy and random rows pick only allowed tokens."""
    rng = np.random.default_rng(3)
    v, r = 70, 6
    allowed = rng.random((r, v)) < 0.2
    allowed[:, 31] = True  # the sign bit of word 0
    bits = np.zeros((r, 3 * 32), np.uint8)
    bits[:, :v] = allowed
    mask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [r, 3]
    logits = rng.standard_normal((r, v)).astype(np.float32)
    got = np.asarray(smp.apply_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(np.isfinite(got), allowed)
    np.testing.assert_array_equal(got[allowed], logits[allowed])
    for mode, t in (("greedy", 0.0), ("random", 1.0), ("filtered", 1.0)):
        s = arrays(r, temperature=t, top_k=5 if mode == "filtered" else 0)
        out = smp.sample(jnp.asarray(logits), s, None, jnp.asarray(mask), mode=mode, num_logprobs=2)
        tok = np.asarray(out.token_ids)
        assert allowed[np.arange(r), tok].all(), mode
        if mode == "greedy":
            np.testing.assert_array_equal(tok, np.where(allowed, logits, -np.inf).argmax(-1))
        assert np.isfinite(np.asarray(out.top_logprobs)).all()  # the model's own logprobs


@pytest.mark.parametrize("cpu", [False, True], ids=["xla", "cpu_kernel"])
def test_argmax_tokens_is_jnp_argmax_on_ties_infinities_and_nans(cpu):
    argmax = jax.jit(functools.partial(smp.argmax_tokens, cpu=cpu))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 300)).astype(np.float32)
    x[1, [7, 40, 299]] = 9.0                 # ties: the first
    x[2] = -np.inf                           # nothing but -inf: index 0
    x[3, 123] = np.inf
    x[4, [5, 250]] = np.nan                  # NaN counts as the largest: the first NaN
    x[5, 17], x[5, 3] = np.inf, np.nan
    x[6] = 0.0
    x[6, 200] = -0.0                         # -0.0 == 0.0: still index 0
    x[7, 299] = 50.0                         # the last column
    x[8] = np.round(x[8])                    # many ties among small integers
    got = np.asarray(argmax(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got[:6], [int(np.argmax(x[0])), 7, 0, 123, 5, 3])
    # Rows of the vocabulary's size, where XLA:CPU's vectorized float max drops NaNs.
    big = rng.standard_normal((4, 49152)).astype(np.float32)
    big[0, 999] = np.nan                     # a NaN among ordinary logits
    big[1] = np.nan                          # nothing but NaN: index 0, never the vocab size
    big[2, [4096, 30000]] = np.inf           # +inf ties
    big[3, 1] = np.nan
    big[3, 5] = np.inf                       # NaN beats +inf
    got = np.asarray(argmax(jnp.asarray(big)))
    np.testing.assert_array_equal(got, [999, 0, 4096, 1])
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(big), axis=-1)))
    # Widths around the kernel's 16 lanes (a tail after them, or only a tail), one row to 65.
    for r, v in ((1, 1), (3, 15), (65, 16), (2, 17), (5, 33), (7, 4097)):
        y = np.round(rng.standard_normal((r, v)) * 2).astype(np.float32)  # many ties
        y[rng.random(y.shape) < 0.02] = np.nan
        np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(y))),
                                      np.asarray(jnp.argmax(jnp.asarray(y), axis=-1)), f"{r}x{v}")


def test_a_pending_token_filled_on_the_device_equals_the_full_history():
    """A step run ahead (async scheduling) knows each row's history but its last output token,
    which is still on the device: penalty_arrays(pending) + pending_fill + with_pending must
    give the arrays of the full history, and with them the same penalized logits."""
    from jaxkv.core.scheduler_output import ScheduledRequest
    from jaxkv.sampling import rows
    from jaxkv.sampling.params import SamplingParams

    rng = np.random.default_rng(0)
    v, sched, full, last = 600, [], [], []
    for i, n_out in enumerate((1, 5, 513, 0)):  # 512 known + 1: the wider width
        sp = SamplingParams(temperature=0, max_tokens=900, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.2) if n_out else SamplingParams(temperature=0)
        out = rng.integers(0, v, n_out).tolist()
        hist = dict(prompt_token_ids=[3, 4], output_token_ids=out[:-1]) if n_out else {}
        sched.append(ScheduledRequest(str(i), [0], 10, [1], True, sp, 0, 0, max(n_out, 1), **hist))
        full.append(dataclasses.replace(sched[-1], output_token_ids=out) if n_out else sched[-1])
        last.append(out[-1] if n_out else 0)
    spans = [rows.Span(s, i, 1) for i, s in enumerate(sched)]
    ref = rows.penalty_arrays([rows.Span(s, i, 1) for i, s in enumerate(full)], 6, v, 2048)
    pen = rows.penalty_arrays(spans, 6, v, 2048, pending=True)
    assert pen.output_ids.shape == ref.output_ids.shape == (6, 2048)  # past 512: max_model_len
    prev = np.array([0, 0] + last[::-1], np.int32)  # the tokens, in another order, as a sampler output
    src, col = rows.pending_fill(spans, 6, pen.output_ids.shape[1], [5, 4, 3, 2])
    got = smp.with_pending(jax.tree.map(jnp.asarray, pen), jnp.asarray(prev[:3]), jnp.asarray(prev[3:]), src, col)
    np.testing.assert_array_equal(np.asarray(got.output_ids), ref.output_ids)
    logits = jnp.asarray(rng.normal(size=(6, v)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(smp.apply_penalties(logits, got)),
                                  np.asarray(smp.apply_penalties(logits, ref)))
