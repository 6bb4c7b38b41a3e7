"""The runner's sampler: the sampled rows' logits and sampling in jitted programs of their own
(jaxkv/sampling/sampler.py), dispatched after the step and read back to the host.

`RowSampler` is held by ModelRunner (jaxkv/runner/model_runner.py), which builds it with its
`Programs` (jaxkv/runner/compiler.py: the jitted gather, sample and prompt-logprobs functions,
made from `sample_body` and `prompt_logprobs_body` below) and passes the params to each call.
How many rows a step samples is the runner's (its token buckets: jaxkv.runner.buckets.sample_rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np

from jaxkv.sampling import rows
from jaxkv.sampling import sampler as smp


def sample_body(logits, cpu_matmul: bool, token_rows: int = 0):
    """The sampler program's function, to be jitted (static: mode, num_logprobs):
    (params, hidden_rows float [R, hidden_size], SamplingArrays, penalty arrays or None,
    bitmask int32 [R, ceil(V / 32)] or None, pending: None or the arguments of
    sampler.with_pending after the penalty arrays) -> SamplerOutput. `logits(params, hidden)` is
    the model's LM head; `cpu_matmul`: the argmax through the C++ kernel; token_ids padded
    to `token_rows` rows when R is fewer (so a step run ahead reads them whatever R was:
    StepInput.prev_sampled)."""
    def _sample_rows(params, hidden_rows, s, pen, bitmask, pending=None, *, mode, num_logprobs):
        if pending is not None:
            pen = smp.with_pending(pen, *pending)
        o = smp.sample(logits(params, hidden_rows), s, pen, bitmask, mode=mode,
                       num_logprobs=num_logprobs, cpu=cpu_matmul)
        return smp.SamplerOutput(smp.pad_rows(o.token_ids, token_rows), *o[1:])
    return _sample_rows


def prompt_logprobs_body(logits):
    """The prompt-logprobs program's function, to be jitted (static: num_logprobs):
    (params, hidden float [T, hidden_size], targets int32 [T]) -> sampler.prompt_logprobs'
    (logprob, rank, top logprobs, top ids) of every row."""
    def _prompt_logprobs(params, hidden, targets, *, num_logprobs):
        return smp.prompt_logprobs(logits(params, hidden), targets, num_logprobs=num_logprobs)
    return _prompt_logprobs


@dataclass
class SamplerRows:
    """The host side of one sampler call: `mode` (sampler.MODES) and `num_logprobs` (static),
    the per-row SamplingArrays [R], PenaltyArrays or None, the grammar bitmask or None, and
    for a step run ahead whose rows read their history, `source` / `column` (int32 [R],
    sampler.with_pending's) or None."""
    mode: str
    num_logprobs: int
    sampling: smp.SamplingArrays
    penalties: smp.PenaltyArrays | None
    bitmask: np.ndarray | None
    source: np.ndarray | None = None
    column: np.ndarray | None = None


class RowSampler:
    """Dispatches the sampling of a step's rows and reads the results back.

    programs: the runner's Programs (gather_rows, sample, prompt_logprobs); vocab_size,
    max_model_len: the model's; max_logprobs: the most logprobs a request may ask for (the
    sampler programs compute that many whenever one asks)."""

    def __init__(self, programs, *, vocab_size: int, max_model_len: int, max_logprobs: int):
        self.programs = programs
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.max_logprobs = max_logprobs
        self.last_rows: SamplerRows | None = None  # the arrays of the last dispatch

    def dispatch(self, params, hidden, spans, idx, r: int, pending=None):
        """Dispatch the sampling of rows `idx` of `hidden` (`spans` their sequences,
        jaxkv.sampling.rows.Span) padded to `r` sampler rows; returns the sampler's output,
        still on the device. `pending`: for a step run ahead (async scheduling), (prev0,
        prev1, sources): the step before's sampled tokens on the device and each span's index
        in them; each span's last output token is that one (rows.penalty_arrays' pending).
        The host arrays it sent are kept as `last_rows` (a steady batch carries them on)."""
        self.last_rows = self.arrays(spans, r, None if pending is None else pending[2])
        return self.call(params, hidden, idx, self.last_rows, None if pending is None else pending[:2])

    def arrays(self, spans, r: int, sources=None) -> SamplerRows:
        """The host arrays of sampling `spans` in `r` rows; `sources` (a step run ahead's,
        RowSampler.dispatch's pending): each span's last output token is on the device."""
        sp = [x.sched.sampling_params for x in spans]
        want_lp = any(p.logprobs is not None for p in sp)
        pen = src = col = None
        if any(rows.needs_penalties(x.sched) for x in spans):
            pen = rows.penalty_arrays(spans, r, self.vocab_size, self.max_model_len,
                                      pending=sources is not None)
            if sources is not None and any(x.sched.output_token_ids is not None for x in spans):
                src, col = rows.pending_fill(spans, r, pen.output_ids.shape[1], sources)
        return SamplerRows(rows.sampler_mode(sp), max(1, self.max_logprobs) if want_lp else 0,
                           rows.sampling_arrays(spans, r), pen,
                           rows.grammar_bitmask(spans, r, self.vocab_size), src, col)

    def call(self, params, hidden, idx, sr: SamplerRows, prev=None):
        """Dispatch the gather of rows `idx` of `hidden` (padded to the arrays' rows) and
        their sampling with `sr`; `prev`: (prev0, prev1), the device arrays sr.source
        indexes, when some row's last output token is still there."""
        fill = None
        if prev is not None and sr.column is not None:
            fill = (*prev, sr.source, sr.column)
        h = self.programs.gather_rows(hidden, np.pad(idx, (0, len(sr.sampling.temperature) - len(idx))))
        return self.programs.sample(params, h, sr.sampling, sr.penalties, sr.bitmask, fill,
                                    mode=sr.mode, num_logprobs=sr.num_logprobs)

    def carry(self, sr: SamplerRows, keep, out, tokens, r: int, params) -> SamplerRows | None:
        """The arrays of a steady batch's next step (jaxkv/runner/steady_batch.py) after a
        step sampled with `sr`: its rows `keep` (int array) in `r` rows with output positions
        `out` (int32 [kept]); each history's pending column now holds the token read since
        (`tokens`: [id] per row of sr's step, the tokens the device wrote there) and the next
        column is left to the device (source: the row in sr's step's output); `params`: the
        kept rows' SamplingParams. None when a history outgrows its width."""
        n = len(keep)
        s_arr = rows.sampling_arrays([], r)
        for a, old in zip(s_arr, sr.sampling):
            a[:n] = old[keep]
        s_arr.step[:n] = out
        pen, src, col = sr.penalties, None, None
        if not any(p.has_penalties or p.has_logits_filters for p in params):
            pen = None  # (as RowSampler.arrays: the rows that needed them are gone)
        if pen is not None:
            width = pen.output_ids.shape[1]
            last = sr.column[keep] if sr.column is not None else np.full(n, width)  # (width: none)
            has = np.flatnonzero(last < width)
            if (last[has] + 1 >= width).any():
                return None
            fields = []
            for a, fill in zip(pen, rows.penalty_padding(self.vocab_size)):
                b = np.full((r, *a.shape[1:]), fill, a.dtype)
                b[:n] = a[keep]
                fields.append(b)
            pen = smp.PenaltyArrays(*fields)
            pen.output_ids[has, last[has]] = np.fromiter((t[0] for t in tokens), np.int32, len(tokens))[keep[has]]
            if len(has):  # (as RowSampler.arrays: no fill when no row has a history)
                src, col = np.zeros(r, np.int32), np.full(r, width, np.int32)
                src[:n], col[has] = keep, last[has] + 1
        lp = max(1, self.max_logprobs) if any(p.logprobs is not None for p in params) else 0
        return SamplerRows(rows.sampler_mode(params), lp, s_arr, pen, None, src, col)

    def merge(self, kept: SamplerRows, fresh: SamplerRows, is_new: np.ndarray, sources,
              r: int, params) -> SamplerRows:
        """The sampler rows of a step whose rows (bool `is_new` [m], in the step's order) are
        rows carried on (`kept`, from carry, whose arrays it edits: its first rows, in that
        order) and new ones (`fresh`, from arrays of their predictions: its first rows, in
        that order), padded to `r` rows; `sources` (int [m]): each row's pending token in the
        step before's two outputs (as arrays'); `params`: the m rows' SamplingParams. Each
        padded penalty field takes the wider of its two widths; a side without penalty arrays
        gives its rows the padding's fills, and a row without a history no pending column."""
        m = len(is_new)
        at_k, at_f = np.flatnonzero(~is_new), np.flatnonzero(is_new)
        n, in_place = len(at_k), bool((at_k == np.arange(len(at_k))).all())  # (new rows last)
        put = functools.partial(_put, r=r, at=(at_k, at_f), in_place=in_place)
        sampling = type(kept.sampling)(*(put((x, y), pad[0]) for x, y, pad in
                                         zip(kept.sampling, fresh.sampling, rows.sampling_arrays([], 1))))
        pen = src = col = None
        if kept.penalties is not None or fresh.penalties is not None:
            fills = rows.penalty_padding(self.vocab_size)
            pen = smp.PenaltyArrays(*(put((None if kept.penalties is None else kept.penalties[f],
                                           None if fresh.penalties is None else fresh.penalties[f]), fill)
                                      for f, fill in enumerate(fills)))
            width = pen.output_ids.shape[1]
            c_ = np.full(m, width, np.int32)
            for sr, at, k in ((kept, at_k, n), (fresh, at_f, m - n)):
                if sr.column is not None:  # (its "none" marker, its own width, becomes ours)
                    c = sr.column[:k]
                    c_[at] = np.where(c >= sr.penalties.output_ids.shape[1], width, c)
            if (c_ < width).any():  # (as arrays: no fill when no row has a history)
                src, col = np.zeros(r, np.int32), np.full(r, width, np.int32)
                src[:m], col[:m] = sources, c_
        lp = max(1, self.max_logprobs) if any(p.logprobs is not None for p in params) else 0
        return SamplerRows(rows.sampler_mode(params), lp, sampling, pen, None, src, col)

    def collect(self, res, sampled, spans) -> None:
        """Read the sampler's output to the host into RunnerOutput `res`: each span's kept
        tokens (and logprobs)."""
        if any(x.sched.sampling_params.logprobs is not None for x in spans):
            o = jax.device_get(sampled)
        else:  # the tokens only (one transfer, not five)
            o = smp.SamplerOutput(jax.device_get(sampled.token_ids), None, None, None, None)
        tokens = o.token_ids.tolist()  # Python ints at once (not a numpy scalar per row)
        for x in spans:
            s = x.sched
            if x.count == 1:  # no draft: the row's token
                res.sampled[s.request_id] = [tokens[x.row]]
                keep = 1
            else:
                ys = tokens[x.row:x.row + x.count]
                keep = rows.num_accepted(ys, s.spec_token_ids) + 1
                res.sampled[s.request_id] = ys[:keep]
            if s.sampling_params.logprobs is not None:
                k = s.sampling_params.logprobs
                res.logprobs[s.request_id] = [
                    (float(o.logprob[i]), int(o.rank[i]), o.top_logprobs[i, :k], o.top_ids[i, :k])
                    for i in range(x.row, x.row + keep)]

    def prompt_logprobs_into(self, params, res, hidden, qsl, out, t: int) -> None:
        """The prompt logprobs of every sequence of SchedulerOutput `out` that asks for them,
        from the step's `hidden` (t rows; qsl: its query_start_loc), into `res`."""
        targets = np.zeros(t, np.int32)
        for i, s in enumerate(out.scheduled):
            n = len(s.prompt_logprob_targets)
            targets[qsl[i]:qsl[i] + n] = s.prompt_logprob_targets
        o = jax.device_get(self.programs.prompt_logprobs(params, hidden, targets,
                                                         num_logprobs=max(1, self.max_logprobs)))
        for i, s in enumerate(out.scheduled):
            n, k = len(s.prompt_logprob_targets), s.sampling_params.prompt_logprobs
            if n:
                sl = slice(qsl[i], qsl[i] + n)
                res.prompt_logprobs[s.request_id] = (o[0][sl], o[1][sl], o[2][sl, :k], o[3][sl, :k])


def _put(sides, fill, *, r: int, at, in_place: bool) -> np.ndarray:
    """One field of RowSampler.merge: the kept side's first rows (of an array of r rows whose
    other rows hold `fill`, or None: fill) to rows at[0], the fresh side's first rows (or
    None) to rows at[1], in an array of r rows as wide as the wider side, `fill` elsewhere:
    the kept side's own array when its rows stay in place and it is that wide."""
    kept, fresh = sides
    like = kept if kept is not None else fresh
    wide = like.ndim == 2
    width = max(a.shape[1] for a in sides if a is not None) if wide else 0
    if kept is not None and in_place and (not wide or kept.shape[1] == width):
        out = kept
    else:
        out = np.full((r, width) if wide else (r,), fill, like.dtype)
        if kept is not None:
            out[(at[0], *([slice(kept.shape[1])] if wide else []))] = kept[:len(at[0])]
    if fresh is not None:
        out[(at[1], *([slice(fresh.shape[1])] if wide else []))] = fresh[:len(at[1])]
    return out
