"""Continuous batching under a token budget, vLLM V1 style (host, plain Python, no JAX).

There are no prefill/decode phases: every request has num_computed_tokens catching up with
its token count, and each step grants each request min(tokens it still needs, budget left)
under max_num_batched_tokens, running requests first, then waiting ones in FCFS order. Chunked
prefill, mixed prefill+decode steps, prefix hits, decode and resumption after preemption all
follow from that. When blocks run out the newest running request is preempted by recompute
(blocks freed, tokens kept, requeued at the front of the waiting queue); with
`preemption_mode="swap"` its computed full blocks are first copied to the host tier and
pinned there, so that it resumes by loading them instead of computing them again (a block
the full tier cannot take, and the last partial block, are computed again).

A step is committed by `update_from_output` (jaxkv/core/step_commit.py) once the runner has
run it. If it never runs (the runner raised, Ctrl-C), `undo_step` puts back what scheduling
it changed: the hashes it registered are forgotten and its requests are requeued to recompute
what the step would have computed, exactly as after a preemption; blocks computed by earlier
steps keep their hashes. If the failure also lost the pool's contents, `drop_all_kv` sends
every request back to recompute.

Speculative decoding (jaxkv.core.spec_decode): once every running and newly admitted request has
its tokens, each decoding one gets its n-gram draft from the budget left over, while free
blocks last (a draft never preempts anyone and never delays a prompt: a short budget drops
drafts first). After the step num_computed_tokens advances over the accepted tokens only;
blocks holding nothing but rejected positions are freed, and a draft never enters a hashed
block (only a request's own tokens are hashed). With async scheduling a sampling request gets
lookahead slots past its tokens when left free (`_allocate_lookahead`); multi-step decode: core/multi_step.py.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from .kv_cache_manager import KVCacheManager
from .multi_step import multi_steps
from .request import Request, RequestStatus
from .scheduler_output import ScheduledRequest, SchedulerOutput
from .step_commit import StepCommit
from .spec_decode import NgramProposer, SpecDecodingStats, SpeculativeConfig
from .grammar import StructuredOutputManager, wait_for_any

if TYPE_CHECKING:
    from jaxkv.engine_config import SchedulerConfig


class Scheduler(StepCommit):
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig,
                 speculative: SpeculativeConfig | None = None,
                 structured_output_manager: StructuredOutputManager | None = None):
        """kv: the KV cache manager; structured_output_manager: fills the grammar bitmasks of
        constrained rows (None: constrained requests cannot be scheduled)."""
        self.kv = kv
        self.config = config
        self.preemption_mode = config.preemption_mode
        self.num_swapped_out = 0  # preemptions by swap (blocks copied to the host tier)
        self.block_size = kv.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.pending_forks: dict[str, list[Request]] = {}  # parent id -> children waiting for its prompt
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0
        self.proposer = NgramProposer(speculative) if speculative else None
        self.structured_output_manager = structured_output_manager
        self.spec_stats = (SpecDecodingStats(speculative.num_speculative_tokens)
                           if speculative else None)
        # Journal of the step being scheduled: (request, was running, prefix lookup counted
        # now as (queried, hit) or None, first scheduled now).
        self._step_journal: list[tuple[Request, bool, tuple[int, int] | None, bool]] = []

    # ---- intake -------------------------------------------------------------------------
    def add_request(self, req: Request, children: list[Request] = ()) -> None:
        """Queue `req`; `children` (samples 1..n-1) fork from it once its prompt is computed."""
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if children:
            for c in children:
                self.requests[c.request_id] = c
            self.pending_forks[req.request_id] = list(children)
            req.fork_position = (req.num_prompt_tokens - 1) // self.block_size * self.block_size

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
        """Choose this step's requests and token counts; allocates their slots. The step
        stays undoable (undo_step) until update_from_output() commits it."""
        self.kv.begin_step()
        self._step_journal = []
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted: list[str] = []
        now = time.monotonic()

        budget = self._schedule_running(chosen, budget, preempted)
        budget = self._schedule_waiting(chosen, budget, preempted, now)
        if not chosen and not self.running and self.waiting:
            compiling = [r.grammar for r in self.waiting if r.grammar is not None and not r.grammar.ready]
            if compiling:  # nothing else to run: wait a little for a grammar, run nothing
                wait_for_any(compiling, timeout=0.05)
                return SchedulerOutput([], preempted, self.kv.transfers)
            # Only forked children (n > 1) hold blocks while waiting; if they starve the head
            # of the queue, they give their shared blocks back and recompute (or hit the cache).
            for req in self.waiting:
                if self.kv.get_block_ids(req.request_id):
                    self._reset(req, req.status)
            budget = self._schedule_waiting(chosen, budget, [], now)
            if not chosen:
                raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, "
                                   f"{self.kv.num_free_blocks} free blocks")

        steps = (multi_steps(chosen, self.kv, self.config.num_scheduler_steps, self.config.max_model_len)
                 if self.config.num_scheduler_steps > 1 else {})
        if self.proposer is None:  # each request's lookahead slots, then its description
            scheduled = self._describe_all(chosen, steps, self.config.num_lookahead_tokens)
        else:  # lookahead, then drafts: they take only the budget the requests' own tokens left
            if self.config.num_lookahead_tokens:
                self._allocate_lookahead(chosen, steps)
            drafts, limit = {}, self.proposer.disable_by_batch_size
            if budget > 0 and (limit is None or len(self.running) < limit):
                drafts = self._propose_drafts(chosen, budget)
            scheduled = [self._describe(req, n, drafts.get(req.request_id, []), steps.get(req.request_id, 1))
                         for req, n in chosen]
        rows = [(s, req.grammar) for (req, _), s in zip(chosen, scheduled)
                if s.sample and req.grammar is not None and req.grammar.matcher is not None]
        if rows:  # each constrained sequence that samples gets its allowed-token row
            self.structured_output_manager.attach_bitmasks(rows)
        return SchedulerOutput(scheduled, preempted, self.kv.transfers)

    def _schedule_running(self, chosen: list, budget: int, preempted: list[str]) -> int:
        """The running requests in order, each with as many tokens as the budget leaves,
        preempting from the back of the queue when the pool has no slots; returns the budget
        left."""
        i, running, allocate = 0, self.running, self.kv.allocate_slots
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens = len(req.all_token_ids)
            if req.num_computed_tokens >= num_tokens:
                # Credited but never given its token (a step interrupted after it ran):
                # compute the last position again so the request samples and goes on.
                req.num_computed_tokens = num_tokens - 1
            n = min(num_tokens - req.num_computed_tokens, budget)
            while not allocate(req, n):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    n = 0
                    break
            if n == 0:
                break
            self._step_journal.append((req, True, None, False))
            chosen.append((req, n))
            budget -= n
            i += 1
        return budget

    def _allocate_lookahead(self, chosen, steps: dict[str, int]) -> None:
        """num_lookahead_tokens more slots (within max_model_len) past the positions this step
        computes (`steps`: the multi-step decodes' steps) for each chosen request that samples
        and may go on, from blocks left free (a failed allocate_slots changes nothing)."""
        ahead, max_len, kv = self.config.num_lookahead_tokens, self.config.max_model_len, self.kv
        for req, n in chosen:
            m = steps.get(req.request_id, 1) if steps else 1
            done = req.num_computed_tokens + n  # (per sequence per step: no properties)
            extra = min(ahead, max_len - done - m + 1)
            if (extra > 0 and done == len(req.all_token_ids)
                    and len(req.output_token_ids) + m < req.sampling_params.max_tokens):
                kv.allocate_slots(req, n + m - 1 + extra)  # (returns at once when held)

    def _describe_all(self, chosen, steps: dict[str, int], ahead: int) -> list[ScheduledRequest]:
        """The ScheduledRequests of `chosen` (no drafts), request by request after its `ahead`
        lookahead slots (_allocate_lookahead's rule, in the same order: the same blocks), in
        one pass: this runs per sequence per step."""
        max_len, kv, held, out = self.config.max_model_len, self.kv, self.kv.get_block_ids, []
        for req, n in chosen:
            m = steps.get(req.request_id, 1) if steps else 1
            blocks = held(req.request_id)
            if ahead:
                done = req.num_computed_tokens + n
                extra = min(ahead, max_len - done - m + 1)
                if (extra > 0 and done == len(req.all_token_ids)
                        and len(req.output_token_ids) + m < req.sampling_params.max_tokens
                        and done + m - 1 + extra > len(blocks) * self.block_size):  # (not held yet)
                    kv.allocate_slots(req, n + m - 1 + extra)
                    blocks = held(req.request_id)
            out.append(self._describe(req, n, (), m, blocks))
        return out

    def _propose_drafts(self, chosen, budget) -> dict[str, list[int]]:
        """Draft tokens for the decoding requests of `chosen` (updated in place to 1 + draft
        tokens), within `budget`, max_tokens, max_model_len and the free blocks."""
        drafts = {}
        for i, (req, n) in enumerate(chosen):
            if budget <= 0:
                break
            if req.num_tokens - req.num_computed_tokens != 1 or req.grammar is not None:
                continue  # a prompt chunk, or a constrained request (no drafts)
            k = min(self.proposer.k, budget, req.max_tokens - req.num_output_tokens - 1,
                    self.config.max_model_len - req.num_tokens)
            draft = self.proposer.propose(req.all_token_ids, k) if k > 0 else []
            if draft and self.kv.allocate_slots(req, 1 + len(draft)):
                chosen[i] = (req, 1 + len(draft))
                drafts[req.request_id] = draft
                budget -= len(draft)
        return drafts

    def _schedule_waiting(self, chosen, budget, preempted, now) -> int:
        """Admit waiting requests in FCFS order while budget, seats and blocks last; a
        request whose grammar is still compiling is passed over (vLLM's WAITING_FOR_FSM)."""
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = next((r for r in self.waiting if r.grammar is None or r.grammar.ready), None)
            if req is None:
                break
            hit_blocks, num_hit, loads = [], 0, []
            if req.num_computed_tokens == 0:  # a forked child already holds shared blocks
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                loads = self.kv.get_lower_tier_hits(req, len(hit_blocks))
            num_hit += len(loads) * self.block_size
            n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hit_blocks, loads):
                break
            self.kv.release_swapped(req.request_id)  # its swapped blocks are back (or lost)
            self.waiting.remove(req)
            lookup = None
            if req.num_cached_tokens < 0:  # first admission: count the prefix-cache lookup
                req.num_cached_tokens = num_hit
                if self.kv.enable_caching and req.sampling_params.prompt_logprobs is None:
                    lookup = (req.num_prompt_tokens, num_hit)
                    self.kv.record_prefix_lookup(*lookup)
            req.num_computed_tokens += num_hit
            req.status = RequestStatus.RUNNING
            first = req.times.first_scheduled_time is None
            if first:
                req.times.first_scheduled_time = now
            self._step_journal.append((req, False, lookup, first))
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
        return budget

    def _describe(self, req: Request, n: int, draft: list[int], num_steps: int = 1,
                  block_ids: list[int] | None = None) -> ScheduledRequest:
        """The ScheduledRequest of `req` with n tokens (its own, then `draft`'s) and
        num_steps; `block_ids`: its block table as the KV cache manager holds it (copied
        here; default: looked up). A history-reading request's prompt and output lists are
        its own, not copies: async scheduling matches a step run ahead by their identity
        (jaxkv/runner/lookahead.py same_step)."""
        start, sp, num_output, tokens = (req.num_computed_tokens, req.sampling_params,
                                         len(req.output_token_ids), req.all_token_ids)
        if draft:
            n -= len(draft)  # the request's own tokens
        token_ids = tokens[start:start + n]
        targets = []
        if sp.prompt_logprobs is not None and req.sample_index == 0 and start + 1 < req.num_prompt_tokens:
            targets = tokens[start + 1:min(start + n + 1, req.num_prompt_tokens)]
        history = req.reads_history
        return ScheduledRequest(  # positional (per sequence per step): the fields in order
            req.request_id, token_ids + draft if draft else token_ids, start,
            list(self.kv.get_block_ids(req.request_id) if block_ids is None else block_ids),
            start + n == len(tokens), sp,
            req.seed, req.sample_index, num_output,
            req.prompt_token_ids if history else None, req.output_token_ids if history else None,
            targets, list(req.stop_ids) if num_output < sp.min_tokens else [], list(draft), None,
            req.bad_words_token_ids, num_steps)

    def _reset(self, req: Request, status: RequestStatus = RequestStatus.PREEMPTED) -> None:
        """Give back req's blocks: it computes again from its first token (or a prefix hit)."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = status

    def _preempt(self, req: Request) -> None:
        if self.preemption_mode == "swap" and self.kv.swap_out(req):
            self.num_swapped_out += 1
        self._reset(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _fork(self, parent: Request, kids: list[Request]) -> None:
        shared = (parent.num_prompt_tokens - 1) // self.block_size
        parent.fork_position = None  # the children hold what they need now
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
        self.kv.release_swapped(req.request_id)
        self.requests.pop(req.request_id, None)
        if req.grammar is not None:
            req.grammar.release()

    def reset_prefix_cache(self) -> bool:
        """False (nothing dropped) while any request holds blocks, as vLLM."""
        return self.kv.reset_prefix_cache()
