"""The fast path of a steady decode (jaxkv/runner/steady_batch.py) against the general one: from
the same scheduled step, SteadyBatch's arrays must give exactly the StepInput and sampler rows
that lookahead.plan + build_step_input + fused_sampling give, and it must refuse every step
that does not ask what it computed."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from jaxkv.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxkv.runner import lookahead as la
from jaxkv.runner.input_builder import build_step_input, decode_step_input, padding_sampling
from jaxkv.runner.steady_batch import SteadyBatch, padded
from jaxkv.sampling import fused_sampling as fs
from jaxkv.sampling.params import SamplingParams

BS, MAX_LEN, ROWS, MAX_BLOCKS = 4, 40, 16, 10
ROPE = (np.random.default_rng(0).random((MAX_LEN, 4), np.float32),
        np.random.default_rng(1).random((MAX_LEN, 4), np.float32))


def _plan_input(scheduled, prev, sources=None, prev1=None):
    """(predicted, their sources, StepInput before sampling) of the step run ahead after
    `scheduled`, as RunAhead._run_ahead makes it (every sequence's token in row i of `prev`,
    unless `sources` maps its id to (output 0 or 1, row), output 1 being `prev1`; one bucket
    of ROWS tokens); Nones when it is not run ahead."""
    sources = sources or {s.request_id: (0, i) for i, s in enumerate(scheduled)}
    plan = la.plan(scheduled, sources, BS, MAX_LEN, ROWS)
    if plan is None:
        return None, None, None
    predicted, index = plan
    si = build_step_input(SchedulerOutput(predicted), block_size=BS, num_tokens=ROWS, rows=ROWS,
                          max_blocks=MAX_BLOCKS, rope_table=ROPE, mark_decode_only=True,
                          prev_rows=ROWS, fused_sampling=True)
    prev_index = si.prev_index.copy()
    prev_index[:len(index)] = index
    pair = (prev, prev if prev1 is None else prev1)
    return predicted, index, dataclasses.replace(si, prev_sampled=pair, prev_index=prev_index)


def _general(scheduled, prev):
    """(predicted, StepInput) of the step run ahead after `scheduled`, its program sampling."""
    predicted, _, si = _plan_input(scheduled, prev)
    return (None, None) if predicted is None else (predicted, fs.with_sampling(si, fs.spans(predicted)))


def _fast(batch, scheduled, match, prev):
    step = batch.advance(match[1], match[0], BS, MAX_LEN)
    if step is None:
        return None, None
    keep, pos, out, tables = step
    si = decode_step_input(pos, tables, (prev, prev), keep,
                           batch.sampling_rows(keep, out, padding_sampling(ROWS)),
                           batch.sample_mode(keep), block_size=BS, num_tokens=ROWS, rows=ROWS,
                           max_blocks=MAX_BLOCKS, rope_table=ROPE, mark_decode_only=True)
    return batch.next_batch(scheduled, match[1], keep, pos, out, si), si


def _assert_same_input(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "sampling":
            for name, u, v in zip(x._fields, x, y):
                np.testing.assert_array_equal(u, v, err_msg=name)
        elif f.name == "prev_sampled":
            assert x[0] is y[0] and x[1] is y[1]
        else:
            np.testing.assert_array_equal(x, y, err_msg=f.name)


def _scheduler_step(predicted, tokens, rng):
    """What the scheduler asks next: each prediction as a new ScheduledRequest with its token,
    some block lists grown by a block (a lookahead slot)."""
    out = []
    for q, t in zip(predicted, tokens):
        blocks = list(q.block_ids)
        if rng.random() < 0.5 and len(blocks) < MAX_BLOCKS:
            blocks.append(100 + rng.randrange(100))
        out.append(dataclasses.replace(q, token_ids=[t], block_ids=blocks))
    return out


def _first_step(rng, n):
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]),
                             seed=3, max_tokens=rng.randrange(3, 30)) for _ in range(n)]
    scheduled = []
    for i, p in enumerate(params):
        pos = rng.randrange(2, 24)
        blocks = [1 + 13 * i + j for j in range((pos + 1) // BS + 1 + rng.randrange(2))]
        scheduled.append(ScheduledRequest(f"r{i}", [5], pos, blocks, True, p, 11 * i, i % 2,
                                          rng.randrange(0, 2)))
    return scheduled


@pytest.mark.parametrize("seed", range(12))
def test_the_fast_path_builds_what_the_general_path_builds(seed):
    rng = random.Random(seed)
    prev = np.arange(ROWS, dtype=np.int32)  # (a stand-in for a sampler output on the device)
    predicted, si = _general(_first_step(rng, rng.randrange(1, ROWS + 1)), prev)
    batch, steps = SteadyBatch.of(predicted, si), 0
    assert batch is not None
    while predicted is not None:
        tokens = [rng.randrange(3, 500) for _ in predicted]
        la.Ahead(predicted, fs.spans(predicted), None, batch).fill_tokens(
            {q.request_id: [t] for q, t in zip(predicted, tokens)})
        scheduled = _scheduler_step(predicted, tokens, rng)
        match = batch.matches(scheduled)
        assert match[0] == [i for i, (s, q) in enumerate(zip(scheduled, predicted))
                            if s.block_ids != q.block_ids]
        predicted, si = _general(scheduled, prev)
        batch, fast = _fast(batch, scheduled, match, prev)
        assert (predicted is None) == (batch is None)
        if batch is not None:
            _assert_same_input(si, fast)
            assert batch.ids == tuple(q.request_id for q in predicted)
            again = [la.predict(s, BS, MAX_LEN) for s in batch.source]  # the general path's objects
            assert [(q.num_computed_tokens, q.num_output_tokens, q.block_ids) for q in again] == \
                   [(q.num_computed_tokens, q.num_output_tokens, q.block_ids) for q in predicted]
        steps += 1
    assert steps >= 1


def _steady(n=3):
    rng = random.Random(5)
    scheduled = _first_step(rng, n)
    for s in scheduled:
        s.sampling_params.max_tokens = 50
    predicted, si = _general(scheduled, np.zeros(ROWS, np.int32))
    batch = SteadyBatch.of(predicted, si)
    la.Ahead(predicted, None, None, batch).fill_tokens({q.request_id: [7] for q in predicted})
    return batch, [dataclasses.replace(q, block_ids=list(q.block_ids)) for q in predicted]


CHANGES = {
    "token": lambda s: setattr(s, "token_ids", [8]),
    "position": lambda s: setattr(s, "num_computed_tokens", s.num_computed_tokens + 1),
    "output count": lambda s: setattr(s, "num_output_tokens", s.num_output_tokens + 1),
    "params": lambda s: setattr(s, "sampling_params", SamplingParams(max_tokens=50)),
    "seed": lambda s: setattr(s, "seed", s.seed + 1),
    "sample index": lambda s: setattr(s, "sample_index", 7),
    "draft": lambda s: setattr(s, "spec_token_ids", [3]),
    "min_tokens ban": lambda s: setattr(s, "min_tokens_banned_ids", [2]),
    "history": lambda s: setattr(s, "output_token_ids", [1]),
    "grammar": lambda s: setattr(s, "grammar_bitmask", np.zeros(4, np.int32)),
    "two tokens": lambda s: setattr(s, "token_ids", [7, 7]),
    "blocks replaced": lambda s: s.block_ids.__setitem__(0, 999),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_step_that_asks_anything_else_is_refused(change):
    batch, scheduled = _steady()
    assert batch.matches(scheduled)[0] == []
    CHANGES[change](scheduled[1])
    assert batch.matches(scheduled) is None


def test_rows_added_removed_or_reordered_are_refused_but_grown_or_windowed_blocks_are_not():
    batch, scheduled = _steady()
    assert batch.matches(scheduled[:2]) is None
    assert batch.matches(scheduled[::-1]) is None
    assert batch.matches(scheduled + [scheduled[0]]) is None
    scheduled[2].block_ids.append(77)  # a lookahead block
    scheduled[0].block_ids[0] = 0  # freed behind a sliding window
    assert batch.matches(scheduled)[0] == [0, 2]


def test_only_plain_decodes_make_a_batch():
    rng = random.Random(2)
    scheduled = _first_step(rng, 2)
    scheduled[1].sampling_params = SamplingParams(temperature=0, logprobs=1, max_tokens=50)
    scheduled[0].sampling_params.max_tokens = 50
    predicted, si = _general(scheduled, np.zeros(ROWS, np.int32))
    assert SteadyBatch.of(predicted, si) is None
    assert SteadyBatch.of(predicted, dataclasses.replace(si, sample_mode=np.zeros(1, np.int32))) is None


# ---- rows the separate sampler samples (penalties, logprobs, logit_bias) ---------------------
VOCAB = 600


def _general_sampled(scheduled, prev, sampler):
    """(predicted, StepInput, SamplerRows) of the step run ahead after `scheduled` whose rows
    the separate sampler samples, as RunAhead._run_ahead makes them (RowSampler.dispatch's
    arrays, each history's last token pending on the device)."""
    predicted, index, si = _plan_input(scheduled, prev)
    if predicted is None:
        return None, None, None
    return predicted, si, sampler.arrays(fs.spans(predicted), ROWS, index)


def _assert_same_rows(a, b):
    assert (a.mode, a.num_logprobs, a.bitmask) == (b.mode, b.num_logprobs, b.bitmask)
    for x, y in ((a.sampling, b.sampling), (a.penalties, b.penalties)):
        assert (x is None) == (y is None)
        for name, u, v in zip(x._fields, x, y) if x is not None else ():
            np.testing.assert_array_equal(u, v, err_msg=name)
    for u, v in ((a.source, b.source), (a.column, b.column)):
        np.testing.assert_array_equal(u, v)


def _first_sampled_step(rng, n):
    """A step of n sequences with penalties, logprobs or logit_bias (some plain), each with
    its own live history lists (the scheduler hands a request's own, Scheduler._describe)."""
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.2),
             dict(logprobs=2), dict(logit_bias={7: 2.0}), {}]
    scheduled = _first_step(rng, n)
    for s in scheduled:
        s.sampling_params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=3,
                                           max_tokens=rng.randrange(3, 30), **rng.choice(kinds))
        if s.sampling_params.has_penalties:
            s.prompt_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
            s.output_token_ids = [rng.randrange(VOCAB) for _ in range(s.num_output_tokens)]
    return scheduled


@pytest.mark.parametrize("seed", range(12))
def test_the_fast_path_carries_the_separate_samplers_arrays_as_the_general_path_builds_them(seed):
    from jaxkv.sampling.row_sampler import RowSampler
    rng = random.Random(100 + seed)
    sampler = RowSampler(None, vocab_size=VOCAB, max_model_len=MAX_LEN, max_logprobs=5)
    prev = np.arange(ROWS, dtype=np.int32)
    predicted, si, sr = _general_sampled(_first_sampled_step(rng, rng.randrange(1, ROWS + 1)), prev, sampler)
    batch, steps = SteadyBatch.of(predicted, si, sr), 0
    assert batch is not None and batch.sampler is sr
    while predicted is not None:
        tokens = [rng.randrange(3, 500) for _ in predicted]
        la.Ahead(predicted, fs.spans(predicted), None, batch).fill_tokens(
            {q.request_id: [t] for q, t in zip(predicted, tokens)})
        for q, t in zip(predicted, tokens):  # update_from_output: the request's own list grows
            if q.output_token_ids is not None:
                q.output_token_ids.append(t)
        scheduled = _scheduler_step(predicted, tokens, rng)
        match = batch.matches(scheduled)
        assert match is not None
        steps += 1
        predicted, si, sr = _general_sampled(scheduled, prev, sampler)
        step = batch.advance(match[1], match[0], BS, MAX_LEN)
        assert (predicted is None) == (step is None)
        if step is None:
            break
        keep, pos, out, tables = step
        fast = sampler.carry(batch.sampler, keep, out, batch.tokens, ROWS, [batch.params[i] for i in keep])
        _assert_same_rows(sr, fast)
        batch = batch.next_batch(scheduled, match[1], keep, pos, out, si, fast)
    assert steps >= 1


def test_a_sampled_batch_refuses_other_history_lists():
    rng = random.Random(7)
    from jaxkv.sampling.row_sampler import RowSampler
    sampler = RowSampler(None, vocab_size=VOCAB, max_model_len=MAX_LEN, max_logprobs=5)
    scheduled = _first_sampled_step(rng, 4)
    for s in scheduled:
        s.sampling_params = SamplingParams(temperature=0, max_tokens=50, repetition_penalty=1.2)
        s.prompt_token_ids, s.output_token_ids = [1, 2], [3] * s.num_output_tokens
    predicted, si, sr = _general_sampled(scheduled, np.zeros(ROWS, np.int32), sampler)
    batch = SteadyBatch.of(predicted, si, sr)
    la.Ahead(predicted, None, None, batch).fill_tokens({q.request_id: [7] for q in predicted})
    nxt = [dataclasses.replace(q, token_ids=[7]) for q in predicted]
    assert batch.matches(nxt) is not None
    nxt[2] = dataclasses.replace(nxt[2], output_token_ids=list(nxt[2].output_token_ids))  # equal, not its own
    assert batch.matches(nxt) is None
    bad = SamplingParams(temperature=0, max_tokens=50, bad_words=["x"])
    assert SteadyBatch.of([dataclasses.replace(predicted[0], sampling_params=bad)], si, sr) is None


# ---- rows dropped and joined (SteadyBatch.match_rows, join) ---------------------------------
PREV1 = np.arange(ROWS, 2 * ROWS, dtype=np.int32)  # (the program run beside it: sampler output 1)


def _arrival(rng, k):
    """A prompt's last chunk admitted beside a batch (a chunk before it, sampling nothing, one
    time in four; logprobs, which the step program does not sample, one in ten)."""
    n, pos, kind = rng.randrange(1, 5), rng.randrange(0, 20), rng.random()
    blocks = [200 + 13 * k + j for j in range((pos + n) // BS + 1)]  # (its lookahead slot)
    p = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=5, max_tokens=rng.randrange(1, 20),
                       logprobs=1 if kind > 0.9 else None)
    return ScheduledRequest(f"n{k}", [9] * n, pos, blocks, kind > 0.25, p, 17 * k, 0, 0)


def _mixed_step(predicted, tokens, rng, k):
    """The scheduler's step after a batch: its rows, each dropped one time in five (finished,
    aborted, preempted), and up to two arrivals anywhere among them."""
    rows = [s for s in _scheduler_step(predicted, tokens, rng) if rng.random() > 0.2]
    for i in range(rng.randrange(0, 3)):
        rows.insert(rng.randrange(len(rows) + 1), _arrival(rng, k + i))
    return rows


def _joined_run(seed) -> int:
    """One random run of steps with rows dropped and joined, each joined step's arrays checked
    against the general path's; the number of steps joined."""
    rng = random.Random(200 + seed)
    predicted, si = _general(_first_step(rng, rng.randrange(1, 8)), PREV0 := np.arange(ROWS, dtype=np.int32))
    batch, joined, k = SteadyBatch.of(predicted, si), 0, 0
    while predicted is not None and batch is not None:
        tokens = [rng.randrange(3, 500) for _ in predicted]
        la.Ahead(predicted, fs.spans(predicted), None, batch).fill_tokens(
            {q.request_id: [t] for q, t in zip(predicted, tokens)})
        scheduled, k = _mixed_step(predicted, tokens, rng, k), k + 2
        match = batch.match_rows(scheduled)
        if not set(batch.ids) & {s.request_id for s in scheduled}:
            assert match is None
            break
        rows = match[0]
        assert [batch.ids[r] for r in rows if r >= 0] == [s.request_id for s, r in zip(scheduled, rows) if r >= 0]
        rest = [s for s, r in zip(scheduled, rows) if r < 0]
        sources = {s.request_id: (0, r) for s, r in zip(scheduled, rows) if r >= 0}
        sources.update({x.sched.request_id: (1, x.row) for x in fs.spans(rest)})
        predicted, _, si = _plan_input(scheduled, PREV0, sources, PREV1)
        step = batch.join(scheduled, *match, {i: ROWS + r for i, (o, r) in sources.items() if o}, BS, MAX_LEN)
        if predicted is None or any(q.sampling_params.logprobs for q in predicted):
            assert step is None  # (not run ahead; the general path's, its sampler separate)
            break
        order, pos, out, tables, index, sampling = step
        fast = decode_step_input(pos, tables, (PREV0, PREV1), index, padded(sampling, padding_sampling(ROWS)),
                                 fs.mode_of([scheduled[j].sampling_params for j in order]), block_size=BS,
                                 num_tokens=ROWS, rows=ROWS, max_blocks=MAX_BLOCKS, rope_table=ROPE,
                                 mark_decode_only=True)
        _assert_same_input(fs.with_sampling(si, fs.spans(predicted)), fast)
        batch, joined = SteadyBatch.joined(scheduled, order, pos, out, fast), joined + 1
        assert batch.ids == tuple(q.request_id for q in predicted)
        again = [la.predict(s, BS, MAX_LEN) for s in batch.source]  # the general path's objects
        assert [(q.num_computed_tokens, q.num_output_tokens, q.block_ids) for q in again] == \
               [(q.num_computed_tokens, q.num_output_tokens, q.block_ids) for q in predicted]
    return joined


def test_rows_dropped_and_joined_build_what_the_general_path_builds():
    assert sum(map(_joined_run, range(60))) >= 100


def test_a_row_asked_otherwise_or_a_step_without_its_rows_is_not_joined():
    batch, scheduled = _steady()
    assert batch.match_rows(scheduled[1:])[0] == [1, 2]  # row 0 dropped
    assert batch.match_rows(scheduled[::-1])[0] == [2, 1, 0]  # (any order)
    rng = random.Random(3)
    assert batch.match_rows([_arrival(rng, 1)]) is None  # none of its rows
    for change in CHANGES.values():
        batch, scheduled = _steady()
        change(scheduled[1])
        assert batch.match_rows([_arrival(rng, 1)] + scheduled) is None


def _sampled_arrival(rng, k):
    """A prompt's last chunk admitted beside a batch the separate sampler samples: plain,
    with penalties (its own history lists) or logprobs."""
    s = _arrival(rng, k)
    s.sample = True
    kind = rng.choice([dict(repetition_penalty=1.3), dict(frequency_penalty=0.4), dict(logprobs=2), {}])
    s.sampling_params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=5,
                                       max_tokens=rng.randrange(1, 20), **kind)
    if s.sampling_params.has_penalties:
        s.prompt_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        s.output_token_ids = []
    return s


def _sampled_drop_run(seed) -> int:
    """One random run of a batch the separate sampler samples, its steps asking some of its
    rows in any order beside a prompt chunk that samples nothing and up to two new sequences
    that sampled their first token (from the second sampler output); each step's sampler
    rows (RunAhead._joined_sampler_rows: carried, fresh, merged) checked against the general
    path's. The number of steps joined with a new row."""
    from types import SimpleNamespace

    from jaxkv.runner.run_ahead import RunAhead
    from jaxkv.sampling.row_sampler import RowSampler
    rng = random.Random(300 + seed)
    sampler = RowSampler(None, vocab_size=VOCAB, max_model_len=MAX_LEN, max_logprobs=5)
    runner = SimpleNamespace(sampler=sampler, block_size=BS, max_model_len=MAX_LEN)
    prev = np.arange(ROWS, dtype=np.int32)
    predicted, si, sr = _general_sampled(_first_sampled_step(rng, rng.randrange(2, ROWS - 2)), prev, sampler)
    batch, steps, joined = SteadyBatch.of(predicted, si, sr), 0, 0
    while predicted is not None:
        tokens = [rng.randrange(3, 500) for _ in predicted]
        la.Ahead(predicted, fs.spans(predicted), None, batch).fill_tokens(
            {q.request_id: [t] for q, t in zip(predicted, tokens)})
        for q, t in zip(predicted, tokens):
            if q.output_token_ids is not None:
                q.output_token_ids.append(t)
        scheduled = [s for s in _scheduler_step(predicted, tokens, rng) if rng.random() > 0.2]
        rng.shuffle(scheduled)
        chunk = _arrival(rng, 3 * steps)
        scheduled.insert(rng.randrange(len(scheduled) + 1), dataclasses.replace(chunk, sample=False))
        for k in range(rng.randrange(0, 3) if len(scheduled) < ROWS - 2 else 0):
            scheduled.insert(rng.randrange(len(scheduled) + 1), _sampled_arrival(rng, 3 * steps + 1 + k))
        match = batch.match_rows(scheduled)
        if match is None:
            assert all(s.request_id[0] == "n" for s in scheduled)
            break
        sources = {s.request_id: (0, r) for s, r in zip(scheduled, match[0]) if r >= 0}
        rest = [s for s, r in zip(scheduled, match[0]) if r < 0 and s.sample]
        sources.update({x.sched.request_id: (1, x.row) for x in fs.spans(rest)})
        predicted, index, si = _plan_input(scheduled, prev, sources, PREV1)
        step = batch.join(scheduled, *match, {i: ROWS + r for i, (o, r) in sources.items() if o}, BS, MAX_LEN)
        assert (predicted is None) == (step is None)
        if step is None:
            break
        order, pos, out, tables, index, _ = step
        params = [scheduled[j].sampling_params for j in order]
        fast = RunAhead._joined_sampler_rows(runner, scheduled, match[0], order, np.asarray(index), out,
                                             batch, ROWS, params)
        _assert_same_rows(sampler.arrays(fs.spans(predicted), ROWS, index.tolist()), fast)
        joined += any(match[0][j] < 0 for j in order)
        si = decode_step_input(pos, tables, (prev, PREV1), index, padding_sampling(ROWS), np.zeros(1, np.int32),
                               block_size=BS, num_tokens=ROWS, rows=ROWS, max_blocks=MAX_BLOCKS,
                               rope_table=ROPE, mark_decode_only=True)
        batch, steps = SteadyBatch.joined(scheduled, order, pos, out, si, fast), steps + 1
    return joined


def test_a_sampled_batch_drops_and_joins_rows_as_the_general_path_does():
    assert sum(map(_sampled_drop_run, range(40))) >= 30


@pytest.mark.parametrize("kept_pen", [True, False])
def test_merged_sampler_rows_take_the_wider_side_as_arrays_of_every_row_do(kept_pen):
    """RowSampler.merge of rows with short histories (token-id width 512) and a long one
    (4096), or of rows without penalty arrays: the arrays RowSampler.arrays builds for every
    row at once, pending columns included."""
    from jaxkv.sampling.row_sampler import RowSampler
    sampler = RowSampler(None, vocab_size=VOCAB, max_model_len=5000, max_logprobs=5)
    rng = random.Random(5)

    def row(i, n_prompt, pen=True, **kw):
        p = SamplingParams(temperature=0, max_tokens=100, repetition_penalty=1.2 if pen else 1.0, **kw)
        prompt = [rng.randrange(VOCAB) for _ in range(n_prompt)] if pen else None
        outs = [rng.randrange(VOCAB) for _ in range(3)] if pen else None
        return ScheduledRequest(f"m{i}", [0], 700, [1], True, p, 0, 0, 4, prompt, outs)

    kept = [row(0, 10, kept_pen), row(1, 5, pen=False)]
    fresh = [row(2, 600), row(3, 3, pen=False, logit_bias={5: 1.0})]
    final, is_new = [fresh[0], kept[0], kept[1], fresh[1]], np.array([True, False, False, True])
    sources = np.array([16, 1, 2, 17], np.int32)
    merged = sampler.merge(sampler.arrays(fs.spans(kept), 2, [1, 2]),
                           sampler.arrays(fs.spans(fresh), 2, [16, 17]), is_new, sources, 8,
                           [s.sampling_params for s in final])
    expected = sampler.arrays(fs.spans(final), 8, sources.tolist())
    assert expected.penalties.output_ids.shape[1] == 4096
    _assert_same_rows(expected, merged)
