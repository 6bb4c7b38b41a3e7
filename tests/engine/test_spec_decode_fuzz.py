"""tests/engine/test_engine_fuzz.py's harness (prefix-reading fake runner, failures, aborts,
preemption, prefix hits, n > 1) with speculative decoding on: the fake runner verifies the
drafts exactly as the real one (row j sampled from the prefix with drafts[:j], accept up to
the first mismatch plus that token), writes the drafts' "K/V" as the draft prefix that wrote
it, and checks every read. The fake model is a 2nd-order Markov chain so n-gram drafts are
often right. Outputs must equal the reference exactly."""

from __future__ import annotations


import pytest

import tests.engine.test_engine_fuzz as F
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.scheduler import Scheduler
from jaxkv.core.grammar import StructuredOutputManager
from jaxkv.core.scheduler_output import RunnerOutput
from jaxkv.core.spec_decode import SpeculativeConfig
from jaxkv.engine_args import EngineArgs
from jaxkv.engine.llm_engine import LLMEngine
from jaxkv.models.model_config import ModelConfig


def markov_next(seed, index, prefix):
    # A first-order chain over 8 tokens (cycles soon: drafts often right), EOS now and then.
    if hash((seed, index, len(prefix))) % 29 == 0:
        return F.EOS
    return hash((seed % 2, index, prefix[-1])) % 8


class SpecRunner(F.FakeRunner):
    def execute(self, out) -> RunnerOutput:
        self._maybe_fail("before")
        reqs = self.engine.scheduler.requests
        seqs = {}
        for s in out.scheduled:
            true = tuple(reqs[s.request_id].all_token_ids)
            d = list(s.spec_token_ids)
            if d:
                assert s.num_computed_tokens + s.num_scheduled_tokens - len(d) == len(true)
            seqs[s.request_id] = (true, true + tuple(d))
        half = self.rng.randrange(len(out.scheduled) + 1)
        for k, s in enumerate(out.scheduled):
            true, seq = seqs[s.request_id]
            start = s.num_computed_tokens
            assert list(seq[start:start + s.num_scheduled_tokens]) == s.token_ids
            for p in range(start, start + s.num_scheduled_tokens):
                b = s.block_ids[p // F.BS]
                assert b != 0
                self.slots[(b, p % F.BS)] = seq[:p + 1]
            if k == half:
                self._maybe_fail("halfway")
        self._maybe_fail("lost")
        res = RunnerOutput()
        for s in out.scheduled:
            true, seq = seqs[s.request_id]
            for p in range(s.num_computed_tokens + s.num_scheduled_tokens):
                got = self.slots.get((s.block_ids[p // F.BS], p % F.BS))
                assert got == seq[:p + 1], (f"{s.request_id} read position {p}: {got} != {seq[:p + 1]}")
                self.reads += 1
            if s.sample:
                d, toks = list(s.spec_token_ids), []
                for j in range(len(d) + 1):
                    t = F.next_token(s.seed, s.sample_index, seq[:len(true) + j])
                    toks.append(t)
                    if j == len(d) or t != d[j]:
                        break
                res.sampled[s.request_id] = toks
        return res


def make_engine(rng, num_blocks, budget, max_num_seqs, caching, fail_p):
    mc = ModelConfig.from_hf_config(dict(F.FAKE_MODEL, vocab_size=F.V, eos_token_id=F.EOS))
    args = EngineArgs(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, block_size=F.BS,
                      num_gpu_blocks_override=num_blocks, max_model_len=F.MAX_LEN,
                      enable_prefix_caching=caching)
    config = args.create_engine_config(platform="cpu", model_config=mc)
    spec = SpeculativeConfig.from_value({"num_speculative_tokens": rng.choice([1, 3, 5]),
                                         "prompt_lookup_max": 3, "prompt_lookup_min": rng.choice([1, 2])})
    tokenizer = F.FakeTokenizer()
    sched = Scheduler(KVCacheManager(num_blocks, F.BS, caching), config.scheduler, spec,
                      StructuredOutputManager(tokenizer, mc.vocab_size, mc.eos_token_ids))
    runner = SpecRunner(rng, fail_p)
    engine = LLMEngine(config, tokenizer, sched, runner)
    runner.engine = engine
    return engine


@pytest.mark.parametrize("caching", [True, False])
def test_fuzz_spec_engine(caching, monkeypatch):
    monkeypatch.setattr(F, "next_token", markov_next)
    monkeypatch.setattr(F, "make_engine", make_engine)
    totals = {}
    for seed in range(200):
        for k, v in F.run_workload(seed, caching).items():
            totals[k] = totals.get(k, 0) + v
    assert totals["finished"] > 500


def test_fuzz_spec_engine_exercises_drafts(monkeypatch):
    monkeypatch.setattr(F, "next_token", markov_next)
    engines = []

    def mk(*a, **kw):
        engines.append(make_engine(*a, **kw))
        return engines[-1]
    monkeypatch.setattr(F, "make_engine", mk)
    for seed in range(200):
        F.run_workload(seed, True)
    drafted = sum(e.scheduler.spec_stats.num_draft_tokens for e in engines)
    accepted = sum(e.scheduler.spec_stats.num_accepted_tokens for e in engines)
    assert accepted > 500 and drafted - accepted > 500
