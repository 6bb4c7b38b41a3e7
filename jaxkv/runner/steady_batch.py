"""The persistent batch of a steady decode (vLLM V1's InputBatch), async scheduling's fast path
(host side: numpy and plain data).

In a steady decode batch every engine step asks exactly what the step run ahead computed
(jaxkv/runner/lookahead.py), and the step after it is predicted from it. Done per sequence,
that is ~10 passes of Python over ScheduledRequests each step (compare each with its
prediction, predict each again, build the StepInput and the sampler's arrays from the new
objects): 2-2.5 ms of the engine thread at batch 256 on the 2-core CPU. A SteadyBatch keeps
the step run ahead as rows instead: request ids, positions, output counts, seeds, sampling
parameters and block lists as tuples (compared with the scheduler's step at C speed, one
comparison per field), and the dispatched StepInput, whose arrays the next step edits: every
position + 1, the rows of sequences that end by length now dropped, block table rows
rewritten where the scheduler's block list changed, the sampler's rows carried over with
their output position + 1.

A batch is kept only for a step run ahead whose every row decodes one token (no min_tokens
ban, grammar, drafts or prompt logprobs) without multi-step decode: either every row is
plain and the step program samples them (fused sampling), or the separate sampler program
does, with the arrays it was sent (`sampler`, row_sampler.SamplerRows) carried on the same
way (logprobs, penalties, logit_bias, allowed_token_ids): a penalty's token history is its
request's own lists, matched by identity (as lookahead.same_step), and its arrays gain one
column a step, the token read since written where the device wrote it (sampler.with_pending),
the next one left to the device.

A batch also takes a step that asks only some of its rows (the others finished, were
aborted or preempted), in any order, beside sequences it did not hold (a prompt admitted, a
prompt chunk: they run as a program of their own): `match_rows`, then `join` makes the step
after from its arrays, the rows asked that go on joined by the new sequences that go on as
one-token decodes, in the scheduler's order (in a batch the separate sampler samples, their
sampler rows built from their predictions and merged with the rows carried on,
row_sampler.RowSampler.merge; a batch its step program samples joins only rows it can sample). Whatever its checks do not
prove (a row of the batch asked otherwise, a new sequence its program cannot sample) sends the
step down the general path, lookahead.Ahead.split and lookahead.plan, whose predictions are
then made from `source` (the same lookahead.predict).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np

from jaxkv.runner.lookahead import ends_by_length, predict, same_blocks
from jaxkv.sampling.fused_sampling import mode_of
from jaxkv.sampling.rows import Span, sampling_arrays

# The fields that must agree row by row, and those every row of a one-token decode has: equal
# to _PLAIN_ROW, and no grammar bitmask; the history lists (penalties) must be the batch's
# own objects. One C-level pass per getter: this runs per sequence per step.
_ROW = operator.attrgetter("request_id", "num_computed_tokens", "num_output_tokens", "token_ids",
                           "seed", "sample_index", "block_ids", "sampling_params")
_PLAIN = operator.attrgetter("sample", "num_steps", "min_tokens_banned_ids", "spec_token_ids",
                             "prompt_logprob_targets")
_PLAIN_ROW = (True, 1, [], [], [])
_GRAMMAR = operator.attrgetter("grammar_bitmask")
_PROMPTS, _OUTPUTS = operator.attrgetter("prompt_token_ids"), operator.attrgetter("output_token_ids")


def plain_rows(scheduled) -> bool:
    """Whether every ScheduledRequest of `scheduled` is a decode's one sampled token without a
    min_tokens ban or grammar, as far as its own fields tell (its sampling parameters and
    history lists aside)."""
    return (all(map(_PLAIN_ROW.__eq__, map(_PLAIN, scheduled)))
            and all(map(operator.is_, map(_GRAMMAR, scheduled), itertools.repeat(None))))


def _same_objects(a, b) -> bool:
    return all(map(operator.is_, a, b))


def _picker(idx: list[int]):
    """A function giving the tuple of a sequence's items at `idx` (non-empty), at C speed."""
    if len(idx) == 1:
        i = idx[0]
        return lambda xs: (xs[i],)
    return operator.itemgetter(*idx)


def _fused(p) -> bool:
    """Whether SamplingParams `p` let the step program sample its row (fused_sampling.plain)."""
    return (p.logprobs is None and not p.has_penalties and not p.has_logits_filters
            and getattr(p, "structured_outputs", None) is None)


def padded(rows, padding):
    """SamplingArrays `rows` [m] followed by `padding`'s rows past m ([R], R >= m)."""
    return type(rows)(*(np.concatenate([a, pad[len(a):]]) for a, pad in zip(rows, padding)))


def joining(scheduled, rows: list[int], sources: dict, block_size: int, max_model_len: int,
            sampled: bool = False) -> dict | None:
    """The sequences of the step `scheduled` a batch did not hold (`rows` -1, as
    SteadyBatch.match_rows gives them) that go on: {index in `scheduled`: (its prediction,
    lookahead.predict's; its input token's index in the step's two sampler outputs,
    `sources` by request id)}, leaving out prompt chunks that sample nothing and those that
    end by length now; None when one cannot join (not a plain one-token decode, not
    predicted, or, in a batch whose step program samples every row (`sampled` False), a row
    only the separate sampler samples)."""
    new = {}
    for j, s in enumerate(scheduled):
        if rows[j] >= 0 or not s.sample:
            continue
        q = predict(s, block_size, max_model_len)
        if q is None and ends_by_length(s, max_model_len):
            continue
        if (q is None or not plain_rows([q]) or not (sampled or _fused(q.sampling_params))
                or s.request_id not in sources):
            return None
        new[j] = (q, sources[s.request_id])
    return new


@dataclass
class SteadyBatch:
    """The rows (row i = sequence i) of a one-token decode step run ahead. positions: each row's
    query position (its num_computed_tokens); tokens: its input token, [id] each (None until
    the step before has been read); blocks: the block id lists its table rows hold; si: the
    StepInput dispatched (numpy arrays); sampler: the separate sampler's arrays
    (row_sampler.SamplerRows; None: the step program sampled); prompts, outputs: each row's
    history lists (None without penalties); source: the ScheduledRequests it was predicted
    from (one per row, the step before's), from which lookahead.predict makes its
    ScheduledRequests when the general path needs them, and source_rows their rows there;
    None when they were given."""
    ids: tuple
    positions: tuple
    num_output: tuple
    seeds: tuple
    sample_index: tuple
    params: tuple
    blocks: tuple
    si: object
    sampler: object = None
    prompts: tuple = ()
    outputs: tuple = ()
    source: tuple | None = None
    source_rows: list[int] | None = None  # each row's row in the step before (its sampled token)
    tokens: tuple | None = None
    max_tokens: np.ndarray | None = None  # int64 [m]: each row's max_tokens (made when needed)
    index: dict | None = None  # request id -> row (made when needed)

    @classmethod
    def of(cls, predicted, si, sampler=None) -> SteadyBatch | None:
        """The batch of a step run ahead of ScheduledRequests `predicted` with StepInput
        `si`, sampled by its program (`sampler` None: every row plain) or by the separate
        sampler with `sampler` (row_sampler.SamplerRows; no bad_words or grammar); None
        unless every row decodes one token without a min_tokens ban."""
        if si.sampling is None or not predicted or not plain_rows(predicted):
            return None
        ids, pos, out, _, seeds, idx, blocks, ps = zip(*map(_ROW, predicted))
        if sampler is None:
            if int(si.sample_mode[0]) == 0 or not all(map(_fused, ps)):
                return None
        elif int(si.sample_mode[0]) != 0 or sampler.bitmask is not None or any(p.bad_words for p in ps):
            return None
        return cls(ids, pos, out, seeds, idx, ps, blocks, si, sampler,
                   tuple(map(_PROMPTS, predicted)), tuple(map(_OUTPUTS, predicted)))

    def matches(self, scheduled) -> tuple[list[int], tuple] | None:
        """Whether the scheduler's step `scheduled` (ScheduledRequests) asks exactly what
        this batch computed, row for row (lookahead.same_step for every row, in order):
        None if not, else (the rows whose block list changed since: grown past the table, or
        blocks freed behind a sliding window; the step's block lists)."""
        if self.tokens is None or len(scheduled) != len(self.ids):
            return None
        ids, pos, out, toks, seeds, idx, blocks, ps = zip(*map(_ROW, scheduled))
        if (ids != self.ids or pos != self.positions or toks != self.tokens or out != self.num_output
                or seeds != self.seeds or idx != self.sample_index
                or not _same_objects(ps, self.params) or not plain_rows(scheduled)
                or not _same_objects(map(_OUTPUTS, scheduled), self.outputs)
                or not _same_objects(map(_PROMPTS, scheduled), self.prompts)):
            return None
        if blocks == self.blocks:
            return [], blocks
        changed = [i for i, (a, b) in enumerate(zip(blocks, self.blocks)) if a != b]
        return (changed, blocks) if all(same_blocks(blocks[i], self.blocks[i]) for i in changed) else None

    def match_rows(self, scheduled) -> tuple[list[int], list[int], tuple] | None:
        """Whether the scheduler's step `scheduled` asks some of this batch's rows as they were
        computed (lookahead.same_step, in any order) beside sequences the batch does not hold
        (a prompt admitted, a prompt chunk); rows it does not ask (finished, aborted,
        preempted) are dropped. None when some row of the batch is asked otherwise or none is
        asked, else (for each scheduled sequence the batch row it takes, -1 where none; the
        indices in `scheduled` of rows whose block list changed since; the step's block lists)."""
        if self.tokens is None or not scheduled:
            return None
        if self.index is None:
            self.index = {rid: i for i, rid in enumerate(self.ids)}
        ids, pos, out, toks, seeds, idx, blocks, ps = zip(*map(_ROW, scheduled))
        rows = list(map(self.index.get, ids, itertools.repeat(-1)))
        held = list(map(operator.ge, rows, itertools.repeat(0)))
        mine = list(itertools.compress(range(len(rows)), held))
        if not mine:
            return None
        asked = list(itertools.compress(rows, held))
        now, then = _picker(mine), _picker(asked)  # (C-speed gathers: per sequence per step)
        if (now(pos) != then(self.positions) or now(toks) != then(self.tokens)
                or now(out) != then(self.num_output) or now(seeds) != then(self.seeds)
                or now(idx) != then(self.sample_index) or not _same_objects(now(ps), then(self.params))
                or not plain_rows(now(scheduled)) or not _same_objects(map(_OUTPUTS, now(scheduled)), then(self.outputs))
                or not _same_objects(map(_PROMPTS, now(scheduled)), then(self.prompts))):
            return None
        if now(blocks) == then(self.blocks):
            return rows, [], blocks
        changed = [j for j, r in zip(mine, asked) if blocks[j] != self.blocks[r]]
        return (rows, changed, blocks) if all(same_blocks(blocks[j], self.blocks[rows[j]]) for j in changed) else None

    def _max_tokens(self) -> np.ndarray:
        if self.max_tokens is None:
            self.max_tokens = np.fromiter((p.max_tokens for p in self.params), np.int64, len(self.params))
        return self.max_tokens

    def advance(self, blocks: tuple, changed: list[int], block_size: int, max_model_len: int):
        """The next step after the scheduler's step that matched this batch (`blocks`, `changed`:
        what `matches` returned): (the rows kept, int array: those not ending by length now;
        their next positions and output counts, int32 [kept]; their block tables, int32
        [kept, B]) - or None when some kept sequence's next position lies past the blocks it
        holds, or none goes on (as lookahead.plan)."""
        pos = np.array(self.positions, np.int32) + 1  # the next query position
        out = np.array(self.num_output, np.int32) + 1
        lens = np.fromiter(map(len, blocks), np.int32, len(blocks))
        end = (out >= self._max_tokens()) | (pos + 1 >= max_model_len)
        if ((pos // block_size >= lens) & ~end).any() or end.all():
            return None
        tables = self.si.block_tables[:len(self.ids)].copy()
        for i in changed:
            b = blocks[i]
            tables[i, :len(b)], tables[i, len(b):] = b, 0
        keep = np.flatnonzero(~end)
        return keep, pos[keep], out[keep], tables[keep]

    def next_batch(self, scheduled, blocks: tuple, keep, pos, out, si, sampler=None) -> SteadyBatch:
        """The batch of the step `advance` made (StepInput `si`, the separate sampler's arrays
        `sampler` or None): rows `keep` of the scheduler's step `scheduled` (its block lists
        `blocks`)."""
        k = keep.tolist()
        pick = (lambda xs: tuple(xs[i] for i in k)) if len(k) < len(self.ids) else tuple
        return SteadyBatch(pick(self.ids), tuple(pos.tolist()), tuple(out.tolist()), pick(self.seeds),
                           pick(self.sample_index), pick(self.params), pick(blocks), si, sampler,
                           pick(self.prompts), pick(self.outputs), pick(scheduled), k,
                           max_tokens=self.max_tokens[keep])

    def join(self, scheduled, rows: list[int], changed: list[int], blocks: tuple, sources: dict,
             block_size: int, max_model_len: int):
        """The next step after the scheduler's step `scheduled` that match_rows matched (`rows`,
        `changed`, `blocks`: what it returned), joined by the sequences run beside it that go
        on (`joining`; `sources`: their input tokens' indices in the step's two sampler
        outputs by request id, the batch's rows being output 0). Its rows are those going on
        in the order of `scheduled` (as lookahead.plan orders them): (their indices in
        `scheduled`; next positions, output counts and input token indices, int32 [m]; block
        tables, int32 [m, B]; the step program's sampler rows, SamplingArrays [m]) - or None
        when one cannot join, some asked row's next position lies past the blocks it holds,
        or none goes on."""
        new = joining(scheduled, rows, sources, block_size, max_model_len, self.sampler is not None)
        if new is None:
            return None
        every = np.array(rows)
        mine = np.flatnonzero(every >= 0)
        asked = every[mine]
        pos, out = np.array(self.positions, np.int32)[asked] + 1, np.array(self.num_output, np.int32)[asked] + 1
        lens = np.fromiter(map(len, blocks), np.int32, len(blocks))[mine]
        end = (out >= self._max_tokens()[asked]) | (pos + 1 >= max_model_len)
        if ((pos // block_size >= lens) & ~end).any():
            return None
        tables = self.si.block_tables[asked]
        where = {j: k for k, j in enumerate(mine.tolist())} if changed else {}
        for j in changed:
            tables[where[j]] = 0
            tables[where[j], :len(blocks[j])] = blocks[j]
        keep, qs = np.flatnonzero(~end), [q for q, _ in (new[j] for j in sorted(new))]
        js = np.concatenate([mine[keep], np.array(sorted(new), np.int64)]).astype(np.int64)
        if not len(js):
            return None
        order = np.argsort(js, kind="stable")
        new_tables = np.zeros((len(qs), tables.shape[1]), np.int32)
        for i, q in enumerate(qs):
            new_tables[i, :len(q.block_ids)] = q.block_ids
        fresh = sampling_arrays([Span(q, i, 1) for i, q in enumerate(qs)], len(qs))
        old = type(fresh)(*(f[asked[keep]] for f in self.si.sampling))  # (copies)
        old.step[:] = out[keep]  # the output position

        def cat(a, b):
            return np.concatenate([a, b])[order]

        sampling = type(fresh)(*map(cat, old, fresh))
        def ints(xs):
            return np.array(xs, np.int32)

        return (js[order].tolist(), cat(pos[keep], ints([q.num_computed_tokens for q in qs])),
                cat(out[keep], ints([q.num_output_tokens for q in qs])), cat(tables[keep], new_tables),
                cat(asked[keep].astype(np.int32), ints([new[j][1] for j in sorted(new)])), sampling)

    @classmethod
    def joined(cls, scheduled, order: list[int], pos, out, si, sampler=None) -> SteadyBatch:
        """The batch of the step `join` made (StepInput `si`, the separate sampler's arrays
        `sampler` or None; `order`, `pos`, `out` as it returned them): rows `order` of the
        scheduler's step `scheduled`, each predicted from its row there; their input tokens
        are set once read (lookahead.Ahead.fill_tokens)."""
        rows = [scheduled[j] for j in order]
        ids, _, _, _, seeds, idx, blocks, ps = zip(*map(_ROW, rows))
        return cls(ids, tuple(pos.tolist()), tuple(out.tolist()), seeds, idx, ps, blocks, si, sampler,
                   tuple(map(_PROMPTS, rows)), tuple(map(_OUTPUTS, rows)), tuple(rows))

    def sampling_rows(self, keep, out, padding):
        """The step program's sampler arrays of the next step: this step's rows `keep`,
        output positions `out`, padded as `padding` (sampling_arrays' padding rows [R])."""
        n, fields = len(keep), []
        for pad, old in zip(padding, self.si.sampling):
            a = pad.copy()
            a[:n] = old[keep]
            fields.append(a)
        rows = type(padding)(*fields)
        rows.step[:n] = out  # the output position
        return rows

    def sample_mode(self, keep) -> np.ndarray:
        """StepInput.sample_mode of the next step (rows `keep`): this step's unless rows were
        dropped."""
        if len(keep) == len(self.ids):
            return self.si.sample_mode
        return mode_of([self.params[i] for i in keep.tolist()])
