"""Committing or undoing a scheduled step (host, plain Python, no JAX): the Scheduler's side
after the runner ran it (update_from_output: credit the computed tokens, append the sampled
ones, apply the token-level stops) or failed to (undo_step, drop_all_kv). Scheduler inherits
StepCommit; it reads the scheduler's requests, queues, kv, config, spec_stats, pending_forks and
step journal, and calls its _fork, _reset and finish (jaxkv/core/scheduler.py)."""

from __future__ import annotations

import time

from .core_output import EngineCoreOutput, core_output
from .request import Request, RequestStatus, check_stop
from .scheduler_output import RunnerOutput, SchedulerOutput


class StepCommit:
    def update_from_output(self, out: SchedulerOutput, runner_output: RunnerOutput) -> list[EngineCoreOutput]:
        """The step ran (vLLM's name): commit it, credit the computed tokens, fork children
        whose parent's prompt is now done, append the sampled tokens and apply the
        token-level stops (EOS and stop_token_ids once min_tokens are out, max_tokens,
        max_model_len), finishing those requests (their blocks freed). With a draft, the
        runner's tokens are the accepted drafts and one sampled token: num_computed_tokens
        advances over the accepted ones, the blocks past them are freed, and the tokens are
        appended one by one up to the first stop. Returns, in scheduled order, an
        EngineCoreOutput (jaxkv/core/core_output.py, as vLLM V1's scheduler returns them) for
        each scheduled request that got tokens, finished or has prompt logprobs: a prompt
        chunk that samples nothing says nothing. Stop strings are the output processor's."""
        now, outputs, finished, requests = time.monotonic(), [], [], self.requests
        sampled, lps, plps = runner_output.sampled, runner_output.logprobs, runner_output.prompt_logprobs
        max_len = self.config.max_model_len
        for s in out.scheduled:
            rid = s.request_id
            req = requests[rid]
            start, n = s.num_computed_tokens, len(s.token_ids)
            num_prompt = len(req.prompt_token_ids)
            if start < num_prompt:
                self.num_computed_prompt_tokens += min(start + n, num_prompt) - start
            tokens = sampled.get(rid, ())
            rejected = 0
            if s.spec_token_ids and tokens:
                rejected = len(s.spec_token_ids) - (len(tokens) - 1)
                self.spec_stats.observe(len(s.spec_token_ids), len(tokens) - 1)
            req.num_computed_tokens += n + s.num_steps - 1 - rejected
            if rejected:
                self.kv.trim(req, req.num_computed_tokens)
            if self.pending_forks:
                kids = self.pending_forks.get(rid)
                if kids and req.num_computed_tokens >= num_prompt:
                    del self.pending_forks[rid]
                    self._fork(req, kids)  # before a finish below frees the parent's blocks
            if len(tokens) == 1 and req.grammar is None:  # a decode's one token (most rows)
                token = tokens[0]
                req.output_token_ids.append(token)
                req.all_token_ids.append(token)
                times = req.times
                if times.first_token_time is None:
                    times.first_token_time = now
                times.last_token_time = now
                new, status = [token], check_stop(req, token, max_len)
            else:
                new, status = self._append_tokens(req, tokens, now)
            plp = (start + 1, plps[rid]) if plps and rid in plps else None
            if status is not None:  # its snapshot once finish() below has run
                finished.append((len(outputs), req, status, new, plp))
                outputs.append(None)
            elif new or plp is not None:
                outputs.append(core_output(req, new, lps.get(rid) if lps else None, plp))
        self.kv.commit_step()
        self._step_journal = []
        for i, req, status, new, plp in finished:
            self.finish(req, status)
            outputs[i] = core_output(req, new, lps.get(req.request_id) if lps else None, plp)
        return outputs

    def _append_tokens(self, req: Request, tokens, now: float) -> tuple[list[int], RequestStatus | None]:
        """Append the step's `tokens` to `req` one by one up to the first stop (or the first
        token its grammar refuses, dropped: FINISHED_ERROR); their times are `now`. Returns
        (the tokens appended, the finish or None)."""
        new, status = [], None
        for token in tokens:
            if req.grammar is not None and not req.grammar.accept(token):
                status = RequestStatus.FINISHED_ERROR  # the token is dropped
                break
            req.append_output_token(token)
            new.append(token)
            times = req.times
            if times.first_token_time is None:
                times.first_token_time = now
            times.last_token_time = now
            status = check_stop(req, token, self.config.max_model_len)
            if status is not None:
                break
        return new, status

    def undo_step(self) -> int:
        """The step last scheduled did not run: forget the block hashes it registered and
        requeue its requests, at the front of the waiting queue in their scheduled order, to
        recompute from their cached prefix (blocks freed, prefix lookups and first-schedule
        times of this step forgotten). Returns the number of requests requeued."""
        self.kv.undo_step_hashes()
        journal, self._step_journal = self._step_journal, []
        requeued = []
        for req, was_running, lookup, first in journal:
            if req.status.is_finished or req.request_id not in self.requests:
                continue
            if req in self.running:
                self.running.remove(req)
            self._reset(req, RequestStatus.PREEMPTED if was_running else RequestStatus.WAITING)
            if lookup is not None:
                self.kv.prefix_cache_queries -= lookup[0]
                self.kv.prefix_cache_hits -= lookup[1]
                req.num_cached_tokens = -1
            if first:
                req.times.first_scheduled_time = None
            requeued.append(req)
        for req in reversed(requeued):
            self.waiting.appendleft(req)
        return len(requeued) + self._requeue_strays()

    def _requeue_strays(self) -> int:
        """Requests in no queue (scheduling interrupted between taking one out of a queue
        and putting it in another) go back to waiting, to recompute. Returns how many."""
        queued = {id(r) for r in self.running} | {id(r) for r in self.waiting}
        queued |= {id(c) for kids in self.pending_forks.values() for c in kids}
        strays = [r for r in self.requests.values()
                  if id(r) not in queued and not r.status.is_finished]
        for req in strays:
            self._reset(req)
            self.waiting.appendleft(req)
        return len(strays)

    def drop_all_kv(self) -> None:
        """The KV pool's contents were lost (call after undo_step): every request recomputes
        from its first token, and no block hash survives."""
        for req in reversed(self.running):
            self._reset(req)
            self.waiting.appendleft(req)
        self.running.clear()
        for req in self.waiting:  # forked children hold their parent's shared blocks
            if self.kv.get_block_ids(req.request_id):
                self._reset(req, req.status)
        self.kv.pool.reset_prefix_cache()
