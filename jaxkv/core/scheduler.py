"""Continuous batching under a token budget, vLLM V1 style (host, plain Python, no JAX).

There are no prefill/decode phases: every request has num_computed_tokens catching up with
its token count, and each step grants each request min(tokens it still needs, budget left)
under max_num_batched_tokens, running requests first, then waiting ones in FCFS order. Chunked
prefill, mixed prefill+decode steps, prefix hits, decode and resumption after preemption all
follow from that. When blocks run out the newest running request is preempted by recompute
(blocks freed, tokens kept, requeued at the front of the waiting queue).
"""

from __future__ import annotations

import time
from collections import deque

from .kv_cache_manager import KVCacheManager
from .scheduler_output import ScheduledRequest, SchedulerOutput
from ..engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pending_forks: dict[str, list[Request]] = {}  # parent id -> children waiting for its prompt
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, req: Request, children: list[Request] = ()) -> None:
        """Queue `req`; `children` (samples 1..n-1) fork from it once its prompt is computed."""
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if children:
            for c in children:
                self.requests[c.request_id] = c
            self.pending_forks[req.request_id] = list(children)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(c) for c in self.pending_forks.values())

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted: list[str] = []
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    n = 0
                    break
            if n == 0:
                break
            chosen.append((req, n))
            budget -= n
            i += 1

        budget = self._schedule_waiting(chosen, budget, preempted, now)
        if not chosen and not self.running and self.waiting:
            # Only forked children (n > 1) hold blocks while waiting; if they starve the head
            # of the queue, they give their shared blocks back and recompute (or hit the cache).
            for req in self.waiting:
                if self.kv.get_block_ids(req.request_id):
                    self.kv.free(req)
                    req.num_computed_tokens = 0
            budget = self._schedule_waiting(chosen, budget, [], now)
            if not chosen:
                raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, "
                                   f"{self.kv.num_free_blocks} free blocks")

        scheduled = [self._describe(req, n) for req, n in chosen]
        return SchedulerOutput(scheduled, preempted)

    def _schedule_waiting(self, chosen, budget, preempted, now) -> int:
        """Admit waiting requests in FCFS order while budget, seats and blocks last."""
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit_blocks, num_hit = [], 0
            if req.num_computed_tokens == 0:  # a forked child already holds shared blocks
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hit_blocks):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # first admission: count the prefix-cache lookup
                req.num_cached_tokens = num_hit
                if self.kv.enable_caching and req.sampling_params.prompt_logprobs is None:
                    self.kv.record_prefix_lookup(req.num_prompt_tokens, num_hit)
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            if req.times.first_scheduled_time is None:
                req.times.first_scheduled_time = now
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
        return budget

    def _describe(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        sp = req.sampling_params
        penalties = sp.has_penalties
        targets = []
        if sp.prompt_logprobs is not None and req.sample_index == 0 and start + 1 < req.num_prompt_tokens:
            targets = req.all_token_ids[start + 1:min(start + n + 1, req.num_prompt_tokens)]
        self.num_computed_prompt_tokens += max(0, min(start + n, req.num_prompt_tokens) - start)
        return ScheduledRequest(
            request_id=req.request_id, token_ids=req.all_token_ids[start:start + n],
            num_computed_tokens=start, block_ids=list(self.kv.get_block_ids(req.request_id)),
            sample=start + n == req.num_tokens, sampling_params=sp, seed=req.seed,
            sample_index=req.sample_index, num_output_tokens=req.num_output_tokens,
            prompt_token_ids=req.prompt_token_ids if penalties else None,
            output_token_ids=req.output_token_ids if penalties else None,
            prompt_logprob_targets=targets,
            min_tokens_banned_ids=req.stop_ids if req.num_output_tokens < sp.min_tokens else [])

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step ----------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        """Credit the computed tokens and fork children whose parent's prompt is now done."""
        for s in out.scheduled:
            req = self.requests[s.request_id]
            req.num_computed_tokens += s.num_scheduled_tokens
            kids = self.pending_forks.get(req.request_id)
            if kids and req.num_computed_tokens >= req.num_prompt_tokens:
                del self.pending_forks[req.request_id]
                self._fork(req, kids)

    def _fork(self, parent: Request, kids: list[Request]) -> None:
        shared = (parent.num_prompt_tokens - 1) // self.block_size
        for kid in reversed(kids):
            self.kv.fork(parent, kid, shared)
            kid.num_computed_tokens = shared * self.block_size
            kid.num_cached_tokens = kid.num_computed_tokens
            self.waiting.appendleft(kid)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark `req` finished (stopped, length or aborted) and free its blocks at once."""
        req.status = status
        req.times.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        for kids in self.pending_forks.values():
            if req in kids:
                kids.remove(req)
        self.pending_forks.pop(req.request_id, None)  # an aborted parent's children are aborted too
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()
