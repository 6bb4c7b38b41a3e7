"""LLMEngine (scheduler + KV cache manager + output processor) fuzzed with a fake runner whose
"K/V" is the token prefix that wrote each slot, so every read through a block table is checked.

Random workloads: arrivals over time, shared prompt prefixes (prefix hits, same-step hits),
n > 1 forks, small pools (preemption), aborts, and injected failures: the runner raising before
or halfway through its writes, a step that loses the whole pool, scheduling raising halfway (also
between taking a preemption victim off the running queue and requeueing it), and output
processing raising after the step ran.
After a failure the harness either steps on (the engine must recompute) or aborts everything
(as LLM.generate does on Ctrl-C). Checked: every slot a step reads holds exactly its sequence's
prefix, block reference counts match the block tables after every step, every finished
request's tokens equal the reference (a deterministic function of its seed and prefix), and
every block is free at the end. No JAX.
"""

from __future__ import annotations

import random

import pytest

from jaxkv.engine_args import EngineArgs
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.scheduler import Scheduler
from jaxkv.core.grammar import StructuredOutputManager
from jaxkv.engine.llm_engine import LLMEngine
from jaxkv.models.model_config import ModelConfig
from jaxkv.core.scheduler_output import RunnerOutput
from jaxkv.sampling.params import RequestOutputKind, SamplingParams

V, EOS, BS, MAX_LEN = 40, 39, 4, 64
FAKE_MODEL = dict(architectures=["LlamaForCausalLM"], hidden_size=8, intermediate_size=16,
                  num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=MAX_LEN)


class InjectedFailure(Exception):
    pass


class FakeTokenizer:
    def __len__(self):
        return V

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        return [f"<{i}>" for i in ids]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)


def next_token(seed: int, index: int, prefix: tuple) -> int:
    """The fake model: a deterministic token for a sequence's whole prefix."""
    return hash((seed, index, prefix)) % V


def reference(prompt, seed, index, max_tokens) -> list[int]:
    out = []
    while len(out) < max_tokens and len(prompt) + len(out) < MAX_LEN:
        out.append(next_token(seed, index, tuple(prompt + out)))
        if out[-1] == EOS:
            break
    return out


class FakeRunner:
    """K/V slot (block, offset) holds the token prefix that wrote it; reads are checked."""

    def __init__(self, rng: random.Random, fail_p: float):
        self.rng, self.fail_p = rng, fail_p
        self.slots: dict[tuple[int, int], tuple] = {}
        self.engine = None  # set by the harness: the truth about each sequence
        self.pool_lost = False
        self.num_compilations = 0
        self.reads = 0

    def _maybe_fail(self, where: str):
        if self.rng.random() < self.fail_p:
            if where == "lost":
                self.pool_lost = True
            raise InjectedFailure(where)

    def execute(self, out) -> RunnerOutput:
        self._maybe_fail("before")
        reqs = self.engine.scheduler.requests
        truth = {s.request_id: tuple(reqs[s.request_id].all_token_ids) for s in out.scheduled}
        half = self.rng.randrange(len(out.scheduled) + 1)
        for k, s in enumerate(out.scheduled):
            true, start = truth[s.request_id], s.num_computed_tokens
            assert list(true[start:start + s.num_scheduled_tokens]) == s.token_ids
            for p in range(start, start + s.num_scheduled_tokens):
                b = s.block_ids[p // BS]
                assert b != 0, "a real token was written to the null block"
                self.slots[(b, p % BS)] = true[:p + 1]
            if k == half:
                self._maybe_fail("halfway")
        self._maybe_fail("lost")
        res = RunnerOutput()
        for s in out.scheduled:  # attention: every position up to the last scheduled one
            true = truth[s.request_id]
            for p in range(s.num_computed_tokens + s.num_scheduled_tokens):
                got = self.slots.get((s.block_ids[p // BS], p % BS))
                assert got == true[:p + 1], (f"{s.request_id} read position {p} from block "
                                             f"{s.block_ids[p // BS]}: {got} != {true[:p + 1]}")
                self.reads += 1
            if s.sample:
                res.sampled[s.request_id] = [next_token(s.seed, s.sample_index, true)]
        return res

    def recover_kv_cache(self) -> bool:
        if not self.pool_lost:
            return False
        self.pool_lost = False
        for key in self.slots:  # the new pool's contents: nothing any sequence wrote
            self.slots[key] = ("garbage",)
        return True


def make_engine(rng, num_blocks, budget, max_num_seqs, caching, fail_p):
    mc = ModelConfig.from_hf_config(dict(FAKE_MODEL, vocab_size=V, eos_token_id=EOS))
    args = EngineArgs(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=BS,
                      num_gpu_blocks_override=num_blocks, max_model_len=MAX_LEN,
                      enable_prefix_caching=caching)
    config = args.create_engine_config(platform="cpu", model_config=mc)
    kv = KVCacheManager(num_blocks, BS, caching)
    tokenizer = FakeTokenizer()
    sched = Scheduler(kv, config.scheduler, None,
                      StructuredOutputManager(tokenizer, mc.vocab_size, mc.eos_token_ids))
    runner = FakeRunner(rng, fail_p)
    engine = LLMEngine(config, tokenizer, sched, runner)
    runner.engine = engine
    return engine


def check_refcounts(engine):
    kv = engine.scheduler.kv
    held: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            held[b] = held.get(b, 0) + 1
    for blk in kv.pool.blocks[1:]:
        assert blk.ref_cnt == held.get(blk.block_id, 0), f"block {blk.block_id} ref count"
        assert (blk.ref_cnt == 0) == (blk.block_id in kv.pool.free_queue)


def run_workload(seed: int, caching: bool = True) -> dict:
    rng = random.Random(seed)
    num_blocks = rng.choice([10, 14, 20, 40])
    max_num_seqs = rng.choice([2, 4, 8])
    budget = rng.choice([max_num_seqs, 8, 16, 32])
    engine = make_engine(rng, num_blocks, max(budget, max_num_seqs), max_num_seqs, caching,
                         fail_p=rng.choice([0.0, 0.03, 0.1]))
    stats = {"failures": 0, "aborts": 0}
    prefixes = [[rng.randrange(EOS) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    expected, results, aborted, pending = {}, {}, set(), list(range(rng.randint(4, 14)))

    def add(i):
        prompt = rng.choice(prefixes) + [rng.randrange(EOS) for _ in range(rng.randint(0, 10))]
        n, mt = rng.choice([1, 1, 1, 2, 3]), rng.randint(1, 16)
        if -(-(len(prompt) + mt) // BS) > num_blocks - 1:
            return
        sp = SamplingParams(n=n, max_tokens=mt, seed=rng.randrange(1000),
                            output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"r{i}", list(prompt), sp)
        expected[f"r{i}"] = [reference(prompt, sp.seed, j, mt) for j in range(n)]

    real_allocate = engine.scheduler.kv.allocate_slots

    def flaky_allocate(*a, **kw):  # scheduling itself raising halfway through a step
        if rng.random() < engine.runner.fail_p / 3:
            raise InjectedFailure("schedule")
        return real_allocate(*a, **kw)
    engine.scheduler.kv.allocate_slots = flaky_allocate

    def flaky(real, where):  # an interrupt landing inside host work around the step
        def wrapper(*a, **kw):
            if rng.random() < engine.runner.fail_p / 3:
                raise InjectedFailure(where)
            return real(*a, **kw)
        return wrapper
    # between taking a victim off the running queue and requeueing it
    engine.scheduler._preempt = flaky(engine.scheduler._preempt, "preempt")
    # after the step ran, while its outputs are processed
    engine.output_processor.process_token = flaky(engine.output_processor.process_token, "output")

    for _ in range(3000):
        while pending and rng.random() < 0.5:
            add(pending.pop(0))
        if not pending and not engine.has_unfinished_requests():
            break
        if rng.random() < 0.03 and engine.output_processor.groups:
            rid = rng.choice(sorted(engine.output_processor.groups))
            engine.abort_request(rid)
            aborted.add(rid)
            stats["aborts"] += 1
        try:
            outs = engine.step()
        except InjectedFailure:
            stats["failures"] += 1
            if rng.random() < 0.3:  # as LLM.generate after Ctrl-C: abort what is left
                left = sorted(engine.output_processor.groups)
                engine.abort_request(left)
                aborted.update(left)
            outs = []
        for o in outs:
            if o.finished and o.request_id not in aborted:
                results[o.request_id] = [c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)]
        check_refcounts(engine)
    else:
        pytest.fail(f"workload {seed}: no progress")
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks, f"workload {seed}: leaked blocks"
    for rid, want in expected.items():
        if rid not in aborted:
            assert results.get(rid) == want, f"workload {seed}: {rid} tokens differ"
    stats.update(preemptions=engine.scheduler.num_preemptions, reads=engine.runner.reads,
                 hits=kv.prefix_cache_hits, finished=len(results))
    return stats


@pytest.mark.parametrize("caching", [True, False])
def test_fuzz_engine_with_prefix_reading_fake_runner(caching):
    totals: dict[str, int] = {}
    for seed in range(200):
        for k, v in run_workload(seed, caching).items():
            totals[k] = totals.get(k, 0) + v
    # The workloads exercise what they claim to: failures, aborts, preemption, prefix hits.
    assert totals["failures"] > 20 and totals["aborts"] > 10 and totals["preemptions"] > 10
    assert totals["finished"] > 500 and totals["reads"] > 10000
    assert (totals["hits"] > 1000) == caching


def test_fuzz_catches_a_poisoned_cache():
    """The harness is honest: with the step journal disabled (hashes of failed steps kept,
    the fault of case C2), the reads find K/V that was never written."""
    found = 0
    for seed in range(200):
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(KVCacheManager, "undo_step_hashes", lambda self: 0)
                run_workload(seed)
        except AssertionError as e:
            found += "read position" in str(e) or "tokens differ" in str(e)
    assert found > 0


def test_abort_drops_outputs_held_back_by_a_failed_step():
    """Outputs kept from a step whose output processing raised never reach the caller after
    the request was aborted (its id may already be reused)."""
    engine = make_engine(random.Random(0), 20, 8, 4, True, fail_p=0.0)
    sp = SamplingParams(max_tokens=8, seed=1, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], sp)
    assert [o.request_id for o in engine.step()] == ["a"]
    real, calls = engine.output_processor.process_token, []

    def once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise InjectedFailure("output")
        return real(*a, **kw)
    engine.output_processor.process_token = once
    with pytest.raises(InjectedFailure):
        engine.step()
    assert engine._pending_outputs  # held back for the next step
    final = engine.abort_request("a")
    assert [(o.request_id, o.finished) for o in final] == [("a", True)]
    engine.add_request("a", [7, 8], SamplingParams(max_tokens=1, seed=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.prompt_token_ids, o.finished) for o in outs] == [("a", [7, 8], True)]
