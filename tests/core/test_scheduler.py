"""Scheduler + KV cache manager fuzzed with a fake runner (no JAX): tiny pools, n > 1 forks,
preemptions and aborts. Every run must finish (no stall), never schedule a request twice in a
step, never exceed the token budget, and leave every block free."""

import random
import sys

import pytest

from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.scheduler import Scheduler
from jaxkv.core.scheduler_output import RunnerOutput
from jaxkv.engine_config import SchedulerConfig
from jaxkv.core.request import Request, RequestStatus
from jaxkv.sampling.params import SamplingParams


def run(seed, caching, abort_p, num_blocks, block_size=4, budget=16, window=None):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, caching, sliding_window=window)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64))
    groups = {}
    for g in range(6):
        p, mt, n = rng.randint(3, 20), rng.randint(1, 8), rng.choice([1, 1, 2, 3])
        if -(-(p + mt) // block_size) > num_blocks - 1:
            continue
        sp = SamplingParams(n=n, max_tokens=mt, temperature=0)
        ids = [rng.randint(0, 5) for _ in range(p)]
        kids = [Request(f"{j}_{g}", ids, sp, None, 0, sample_index=j) for j in range(n)]
        groups[g] = kids
        sched.add_request(kids[0], kids[1:])
    steps = 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "no progress"
        out = sched.schedule()
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) and out.total_num_scheduled_tokens <= budget
        for s in out.scheduled:  # every scheduled token has a slot in the request's blocks
            assert len(s.block_ids) * block_size >= s.num_computed_tokens + s.num_scheduled_tokens
            # ... and every key its first query sees is in a real block (not one freed behind
            # the window, now the null block 0)
            seen = max(s.num_computed_tokens - window + 1, 0) if window else 0
            assert 0 not in s.block_ids[seen // block_size:]
        # Every sampled request gets token 1; update_from_output finishes it at max_tokens.
        sched.update_from_output(out, RunnerOutput({s.request_id: [1] for s in out.scheduled if s.sample}))
        if abort_p and rng.random() < abort_p and groups:
            for c in groups.pop(rng.choice(list(groups))):
                if not c.status.is_finished:
                    sched.finish(c, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in range(1, num_blocks))
    return sched.num_preemptions


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("abort_p", [0.0, 0.2])
def test_fuzz_no_stall_no_leak(caching, abort_p):
    preemptions = sum(run(seed, caching, abort_p, nb) for seed in range(150) for nb in (10, 14))
    assert preemptions > 0  # the pools are small enough to exercise preemption


@pytest.mark.parametrize("caching", [True, False])
def test_fuzz_with_blocks_freed_behind_a_sliding_window(caching):
    """Every layer windowed (5 tokens, blocks of 4): the same runs free blocks behind the
    window as requests advance, never one a query still sees, and leak none (forks of n > 1
    share blocks freed behind the window, preemption frees the rest)."""
    preemptions = sum(run(seed, caching, 0.2, nb, window=5) for seed in range(150) for nb in (10, 14))
    assert preemptions > 0
    # A window wider than a block and a budget that ends chunks off block boundaries: the
    # samples of n > 1 fork behind the parent's last chunk and must still see their whole
    # window (run checks every scheduled request's table).
    for seed in range(150):
        run(seed, caching, 0.0, 14, budget=10, window=7)


def test_budget_chunks_prefill_and_decodes_go_first():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=128))
    a = Request("a", list(range(25)), SamplingParams(max_tokens=3), None, 0)
    sched.add_request(a)
    out = sched.schedule()
    assert [(s.request_id, s.num_scheduled_tokens, s.sample) for s in out.scheduled] == [("a", 10, False)]
    sched.update_from_output(out, RunnerOutput())
    b = Request("b", list(range(100, 104)), SamplingParams(max_tokens=3), None, 0)
    sched.add_request(b)
    out = sched.schedule()  # a's next chunk uses the whole budget; b waits
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 10)]
    sched.update_from_output(out, RunnerOutput())
    out = sched.schedule()  # a's last 5 tokens (samples), then b's whole prompt in the same step
    assert [(s.request_id, s.num_scheduled_tokens, s.sample) for s in out.scheduled] == [
        ("a", 5, True), ("b", 4, True)]
    assert out.scheduled[0].num_computed_tokens == 20


def test_core_imports_no_jax():
    import subprocess
    code = ("import sys, jaxkv.core.scheduler, jaxkv.core.kv_cache_manager, jaxkv.core.kv_budget;"
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_every_eos_id_stops_unless_ignore_eos():
    r = Request("r", [1, 2], SamplingParams(stop_token_ids=[9]), (2, 7), 0)
    assert sorted(r.stop_ids) == [2, 7, 9]
    r = Request("r", [1, 2], SamplingParams(stop_token_ids=[9], ignore_eos=True), (2, 7), 0)
    assert r.stop_ids == [9]


def test_a_request_whose_grammar_compiles_is_passed_over_not_waited_for():
    """vLLM's WAITING_FOR_FSM: the request behind it runs; it joins once its grammar is ready;
    with nothing else to run the step is empty (no stall error)."""
    from concurrent.futures import Future

    from jaxkv.core.grammar import GrammarState

    kv = KVCacheManager(32, 4, True)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64))
    fut = Future()
    slow = Request("slow", [1, 2, 3], SamplingParams(max_tokens=2), None, 0)
    slow.grammar = GrammarState(fut)
    free = Request("free", [4, 5, 6], SamplingParams(max_tokens=1), None, 0)
    sched.add_request(slow)
    sched.add_request(free)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["free"]
    sched.update_from_output(out, RunnerOutput({"free": [7]}))
    out = sched.schedule()  # only the compiling request is left: an empty step
    assert out.scheduled == [] and sched.num_waiting == 1
    fut.set_exception(RuntimeError("no matcher"))  # a failed build ends the request, with an error
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["slow"] and slow.grammar.error
    (upd,) = sched.update_from_output(out, RunnerOutput({"slow": [9]}))
    assert upd.finished == RequestStatus.FINISHED_ERROR and upd.new_token_ids == []
    assert slow.output_token_ids == [] and kv.num_free_blocks == kv.num_total_blocks


def test_lookahead_slots_come_from_blocks_left_free():
    """Async scheduling's lookahead slot (num_lookahead_tokens 1) is handed out after every
    request has its own slots, and not for a last token: blocks of 4, 3 usable; B samples its
    last token at step 2 and C needs the one free block for its own; nobody is preempted, as
    without slots. A prefix hit's request gets its slot too."""
    def go(look):
        kv = KVCacheManager(4, 4, False)
        s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                          max_model_len=64, num_lookahead_tokens=look))
        for rid, p, mt in (("A", 1, 1), ("B", 3, 2), ("C", 4, 2)):
            s.add_request(Request(rid, list(range(1, p + 1)), SamplingParams(max_tokens=mt, temperature=0), None, 0))
        while s.has_unfinished_requests():
            out = s.schedule()
            s.update_from_output(out, RunnerOutput({x.request_id: [11] for x in out.scheduled if x.sample}))
        return s.num_preemptions
    assert go(0) == go(1) == 0
    kv = KVCacheManager(12, 4, True)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                                      num_lookahead_tokens=1))
    for rid in ("first", "again"):  # the same 8-token prompt: the second hits the first block
        s.add_request(Request(rid, list(range(1, 9)), SamplingParams(max_tokens=4, temperature=0), None, 0))
        out = s.schedule()
        x = next(x for x in out.scheduled if x.request_id == rid)
        assert x.sample and len(x.block_ids) == 3  # position 8 (the next token's) has its block
        assert x.num_computed_tokens == (4 if rid == "again" else 0)
        s.update_from_output(out, RunnerOutput({y.request_id: [11] for y in out.scheduled if y.sample}))
