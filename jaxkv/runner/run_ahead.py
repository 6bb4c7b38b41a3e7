"""The runner's side of async scheduling: the step run ahead, predicted by lookahead.py and
dispatched from the launcher's thread (launcher.py). ModelRunner inherits it; it reads the
runner's prev_rows, block_size, max_model_len, multi_step, async_scheduling, build_inputs and
_dispatch, and for the fast path of a steady decode (steady_batch.py) max_num_seqs,
max_blocks, rope_table, mark_decode_only, the fused-sampling limits, _fused_step, forward,
params, compiles and its RowSampler `sampler` (for rows the separate sampler samples).

The KV pool is read through `kv_cache`, which first waits for the launcher's call in flight:
every program that uses the pool then follows the step run ahead on the device, in the order
they were asked for.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future

import jax
import numpy as np

from jaxkv.core.scheduler_output import RunnerOutput, SchedulerOutput
from jaxkv.runner import lookahead as la
from jaxkv.runner.buckets import num_rows, pick_bucket
from jaxkv.runner.input_builder import decode_step_input, padding_sampling
from jaxkv.runner.launcher import Launcher
from jaxkv.runner.steady_batch import SteadyBatch, padded
from jaxkv.sampling import fused_sampling as fs
from jaxkv.sampling.rows import Span

logger = logging.getLogger("jaxkv")


class RunAhead:
    """Async scheduling's state on the runner: the step run ahead (`_ahead`, a
    lookahead.Ahead or None), the launcher that dispatches it (None: the engine thread
    does), and the counts of steps run ahead (dispatched, used, discarded; steady: used by
    the fast path of a steady decode, steady_batch.py)."""
    launcher: Launcher | None = None
    _ahead: la.Ahead | None = None
    num_ahead_dispatched = num_ahead_used = num_ahead_discarded = num_ahead_steady = 0

    @property
    def kv_cache(self):
        """The KV pool (KVPool), once the launcher's call in flight (if any) has dispatched
        the step that updates it."""
        if self.launcher is not None:
            self.launcher.join()
        return self._kv

    @kv_cache.setter
    def kv_cache(self, pool) -> None:
        if self.launcher is not None:
            self.launcher.join()
        self._kv = pool

    @property
    def step_ahead_pending(self) -> bool:
        """Whether a decode step run ahead (async scheduling) waits for the next execute()."""
        return self._ahead is not None

    def _take_ahead(self) -> la.Ahead | None:
        """The step run ahead (None if none), taken for this step: dispatched by now (a step
        of the engine ran since it was launched), its sampler output a device array. If its
        launched call failed, it is discarded: with the pool intact, None (this step runs
        those sequences in line; a lasting fault raises there); else the call's error is
        raised (the step is undone and every request recomputes)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or self.launcher is None:
            return ahead
        try:
            self.launcher.join()
        except Exception as e:  # noqa: BLE001 - its dispatch failed
            self.num_ahead_discarded += 1
            if not self._pool_intact():
                raise
            logger.warning("a step run ahead failed to dispatch (%s); its sequences run in line", e)
            return None
        if isinstance(ahead.sampled, Future):
            ahead.sampled = ahead.sampled.result()
        return ahead

    def _pool_intact(self) -> bool:
        """Whether the KV pool survived the programs dispatched so far (none took it donated
        and failed, none left an error in it); waits for them."""
        try:
            for a in jax.tree.leaves(self.kv_cache):
                if a.is_deleted():
                    return False
                a.block_until_ready()
            return True
        except Exception:  # noqa: BLE001 - any failure to read it back means it is lost
            return False

    def _split(self, out: SchedulerOutput, ahead: la.Ahead | None):
        """(reuse: [(ScheduledRequest, its Span in ahead.sampled)] computed ahead; rest: the
        ScheduledRequests to run now; match: SteadyBatch.match_rows's, or None) of step `out`
        after the step run ahead `ahead` (or None): from its batch's rows when they match, some
        perhaps dropped and others beside them (counted as steady), else from its
        predictions (lookahead.Ahead.split)."""
        if ahead is None:
            return [], out.scheduled, None
        b = ahead.batch
        match = b.match_rows(out.scheduled) if b is not None and self.multi_step is None else None
        if match is None:
            reuse, rest = self._predictions(ahead).split(out.scheduled)
        else:
            reuse, rest = [], []
            for s, r in zip(out.scheduled, match[0]):
                if r >= 0:
                    reuse.append((s, Span(s, r, 1)))
                else:
                    rest.append(s)
            self.num_ahead_steady += 1
        self.num_ahead_used += bool(reuse)
        self.num_ahead_discarded += not reuse
        return reuse, rest, match

    def _run_ahead(self, out: SchedulerOutput, reuse, ahead, runs, match=None) -> la.Ahead | None:
        """Dispatch the predicted next step of `out` (jaxkv/runner/lookahead.py), its input
        ids taken on the device from this step's sampled tokens: those of the sequences
        computed ahead (`reuse`, rows of ahead.sampled) and of the ones run now (each of
        `runs`' spans and sampler output; at most two outputs in all); from ahead's batch's
        arrays where `_split` matched them (`match`) and the sequences run now can join it.
        None when it cannot be predicted."""
        if not self.prev_rows:  # built without async scheduling: no such input
            return None
        if match is not None:
            joined = self._run_ahead_joined(out, ahead, match, runs)
            if joined is not None:
                return joined
        sources, arrays = {s.request_id: (0, x.row) for s, x in reuse}, []
        if reuse:
            arrays.append(ahead.sampled.token_ids)
        for run in runs:
            if run[3]:
                sources.update({x.sched.request_id: (len(arrays), x.row) for x in run[3]})
                arrays.append(run[4].token_ids)
        k = self.multi_step.k if self.multi_step is not None else 1
        plan = (la.plan(out.scheduled, sources, self.block_size, self.max_model_len, self.prev_rows, k)
                if len(arrays) <= 2 else None)
        if plan is None:
            return None
        predicted, index = plan
        try:
            t = pick_bucket(self._usable_buckets, len(predicted))
        except ValueError:
            return None
        si = self.build_inputs(SchedulerOutput(predicted), t)
        prev_index = si.prev_index.copy()
        prev_index[:len(index)] = index  # one query row per sequence, in order
        si = dataclasses.replace(si, prev_sampled=(arrays[0], arrays[-1]), prev_index=prev_index)
        _, spans, sampled, si = self._dispatch(predicted, si, launch=True)
        self.num_ahead_dispatched += 1
        batch = None
        if self.multi_step is None and si.sampling is not None:  # (the sampler's arrays, if it ran)
            batch = SteadyBatch.of(predicted, si, self.sampler.last_rows if int(si.sample_mode[0]) == 0 else None)
        return la.Ahead(predicted, spans, sampled, batch)

    # ---- the fast path of a steady decode (steady_batch.py) ------------------------------
    def _execute_steady(self, out: SchedulerOutput, ahead: la.Ahead) -> RunnerOutput | None:
        """The step `out` when it asks exactly the plain decode step run ahead (`ahead`'s
        batch matches it): dispatch the step after it from the batch's arrays, then read
        the tokens. None, having done nothing, when it does not match."""
        batch = ahead.batch
        if batch is None or self.multi_step is not None or not self.async_scheduling:
            return None  # (switched off at run time: the general path takes the results)
        match = batch.matches(out.scheduled)
        if match is None:
            return None
        self.num_ahead_used += 1
        self.num_ahead_steady += 1
        self._ahead = self._run_ahead_steady(out, ahead, *match)
        if batch.sampler is not None and batch.sampler.num_logprobs:
            res = RunnerOutput()  # (the logprobs too: the sampler's reading)
            self.sampler.collect(res, ahead.sampled, fs.spans(out.scheduled))
            tokens = [res.sampled[rid][0] for rid in batch.ids]
        else:  # (np.asarray, not jax.device_get: its tree walk and extra copy cost ~0.2 ms
            # of the engine thread per step at batch 256 on the 2-core CPU)
            tokens = np.asarray(ahead.sampled.token_ids)[:len(batch.ids)].tolist()
            res = RunnerOutput({rid: [t] for rid, t in zip(batch.ids, tokens)})
        if self._ahead is not None:
            nxt = self._ahead.batch
            nxt.tokens = tuple([tokens[i]] for i in nxt.source_rows)
        return res

    def _run_ahead_steady(self, out: SchedulerOutput, ahead: la.Ahead, changed: list[int],
                          blocks: tuple) -> la.Ahead | None:
        """Dispatch the step after `out` (which matched ahead.batch: `changed` and `blocks`
        as SteadyBatch.matches returns them), its input ids taken from ahead.sampled on the
        device: the batch's arrays edited (SteadyBatch.advance). None when it cannot be
        predicted."""
        batch = ahead.batch
        step = batch.advance(blocks, changed, self.block_size, self.max_model_len)
        if step is None:
            return None
        keep, pos, num_out, tables = step
        try:
            t = pick_bucket(self._usable_buckets, len(keep))
        except ValueError:
            return None
        if t > min(self.fused_program_max_tokens, self.fused_sampling_max_tokens):
            return None  # its program would not sample: the general path's
        r, prev, sr = num_rows(t, self.max_num_seqs), ahead.sampled.token_ids, None
        if batch.sampler is None:  # the step program samples
            sampling, mode = batch.sampling_rows(keep, num_out, padding_sampling(r)), batch.sample_mode(keep)
        else:  # the separate sampler, with its arrays carried on
            sr = self.sampler.carry(batch.sampler, keep, num_out, batch.tokens, r,
                                    [batch.params[i] for i in keep.tolist()])
            if sr is None:
                return None
            sampling, mode = padding_sampling(r), np.zeros(1, np.int32)
        si = decode_step_input(pos, tables, (prev, prev), keep, sampling, mode,
                               block_size=self.block_size, num_tokens=t, rows=r,
                               max_blocks=self.max_blocks, rope_table=self.rope_table,
                               mark_decode_only=self.mark_decode_only)
        sampled = self._launch_steady(si, sr, (prev, prev))
        return la.Ahead(None, None, sampled, batch.next_batch(out.scheduled, blocks, keep, pos, num_out, si, sr))

    def _run_ahead_joined(self, out: SchedulerOutput, ahead: la.Ahead, match, runs) -> la.Ahead | None:
        """Dispatch the step after `out` from ahead.batch's arrays (SteadyBatch.join): its
        rows `out` asked (`match`, SteadyBatch.match_rows) going on, joined by the
        sequences run now (`runs`, one program at most) that sampled and go on as one-token
        decodes (a batch its step program samples joins only rows it can sample). None when some cannot
        join, or its bucket's program would not sample."""
        src = {x.sched.request_id: self.prev_rows + x.row for x in runs[0][3]} if len(runs) == 1 and runs[0][3] else {}
        step = ahead.batch.join(out.scheduled, *match, src, self.block_size, self.max_model_len)
        if step is None:
            return None
        order, pos, num_out, tables, index, sampling = step
        try:
            t = pick_bucket(self._usable_buckets, len(order))
        except ValueError:
            return None
        if t > min(self.fused_program_max_tokens, self.fused_sampling_max_tokens):
            return None
        r, prev, sr, batch = num_rows(t, self.max_num_seqs), ahead.sampled.token_ids, None, ahead.batch
        params = [out.scheduled[j].sampling_params for j in order]
        if batch.sampler is None:  # the step program samples
            sampling, mode = padded(sampling, padding_sampling(r)), fs.mode_of(params)
        else:  # the separate sampler: the rows kept carried on, the new ones' merged in
            sr = self._joined_sampler_rows(out.scheduled, match[0], order, index, num_out, batch, r, params)
            if sr is None:
                return None
            sampling, mode = padding_sampling(r), np.zeros(1, np.int32)
        pair = (prev, runs[0][4].token_ids if src else prev)
        si = decode_step_input(pos, tables, pair, index, sampling, mode, block_size=self.block_size,
                               num_tokens=t, rows=r, max_blocks=self.max_blocks, rope_table=self.rope_table,
                               mark_decode_only=self.mark_decode_only)
        sampled = self._launch_steady(si, sr, pair)
        return la.Ahead(None, None, sampled, SteadyBatch.joined(out.scheduled, order, pos, num_out, si, sr))

    def _joined_sampler_rows(self, scheduled, rows, order, index, num_out, batch, r: int, params):
        """The separate sampler's rows of a joined step (SteadyBatch.join's `order`, `index`,
        `num_out`; `rows`: match_rows'): the batch's rows kept, carried on (RowSampler.carry),
        and the new sequences', built from their predictions with their tokens pending in the
        step's second output (RowSampler.arrays), merged in the step's order. None when a
        history outgrows its width."""
        is_new = np.fromiter((rows[j] < 0 for j in order), bool, len(order))
        kept = self.sampler.carry(batch.sampler, index[~is_new], num_out[~is_new], batch.tokens, r,
                                  [p for p, x in zip(params, is_new) if not x])
        if kept is None or not is_new.any():
            return kept
        qs = [la.predict(scheduled[j], self.block_size, self.max_model_len)
              for j, x in zip(order, is_new) if x]
        fresh = self.sampler.arrays(fs.spans(qs), len(qs), index[is_new].tolist())
        return self.sampler.merge(kept, fresh, is_new, index, r, params)

    def _launch_steady(self, si, sr, prev):
        """Dispatch a steady step `si` (from the launcher's thread when on), sampled by its
        program or, with SamplerRows `sr`, by the separate sampler (`prev`: the device arrays
        its sources index); its sampler output (a Future when launched)."""
        if sr is not None:
            call, args = self._sampled_step, (si, sr, prev)
        else:
            self.num_fused_sampling_steps += 1
            call, args = self._fused_step, (si,)
        self.num_ahead_dispatched += 1
        return self.launcher.launch(call, *args) if self.launcher is not None and self.launch_ahead else call(*args)

    def _sampled_step(self, si, sr, prev):
        """Dispatch a steady step whose rows the separate sampler samples (with SamplerRows
        `sr`; `prev`: the device arrays its sources index), then that sampling (on the
        launcher's thread when launched); the SamplerOutput, still on the device."""
        hidden = self.forward(si)
        with self.compiles:
            return self.sampler.call(self.params, hidden, np.arange(int(si.num_seqs[0])), sr, prev)

    def _predictions(self, ahead: la.Ahead) -> la.Ahead:
        """`ahead` with its predicted ScheduledRequests and spans: made now from its batch's
        source (lookahead.predict, input tokens filled) when the fast path left them out."""
        if ahead.predicted is None:
            b = ahead.batch
            qs = [la.predict(s, self.block_size, self.max_model_len) for s in b.source]
            for q, tok in zip(qs, b.tokens):
                q.token_ids = list(tok)
            ahead.predicted, ahead.spans = qs, fs.spans(qs)
        return ahead
