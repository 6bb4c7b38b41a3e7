"""Speculative decoding on the host (no JAX): the config's validation (vLLM's names and
defaults), the n-gram proposer, and the scheduler fuzzed with a fake runner that accepts a
random prefix of every draft: no block leaked, the budget kept, num_computed_tokens only over
accepted tokens, blocks past them freed, and no draft token ever inside a hashed block."""

import random

import pytest

from jaxkv.engine_args import EngineArgs
from jaxkv.core.block_pool import hash_block_tokens
from jaxkv.core.kv_cache_manager import KVCacheManager, cdiv
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.scheduler import Scheduler
from jaxkv.core.scheduler_output import RunnerOutput
from jaxkv.core.spec_decode import NgramProposer, SpeculativeConfig
from jaxkv.engine_config import SchedulerConfig
from jaxkv.sampling.params import SamplingParams


def cfg(k=3, hi=None, lo=None):
    d = {"method": "ngram", "num_speculative_tokens": k}
    if hi is not None:
        d["prompt_lookup_max"] = hi
    if lo is not None:
        d["prompt_lookup_min"] = lo
    return SpeculativeConfig.from_value(d)


def test_config_defaults_follow_vllm():
    assert (cfg().prompt_lookup_max, cfg().prompt_lookup_min) == (5, 5)
    assert (cfg(hi=4).prompt_lookup_max, cfg(hi=4).prompt_lookup_min) == (4, 4)
    assert (cfg(lo=2).prompt_lookup_max, cfg(lo=2).prompt_lookup_min) == (2, 2)
    c = SpeculativeConfig.from_value('{"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                     '"prompt_lookup_min": 2}')
    assert c.to_dict() == {"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                           "disable_by_batch_size": None}
    assert SpeculativeConfig.from_value(None) is None


@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": -1}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key 'draft_model'"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_config_names_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_value(value)
    with pytest.raises(ValueError, match=match):
        EngineArgs(speculative_config=value)


def test_proposer_longest_match_and_its_continuation():
    p = NgramProposer(cfg(k=3, hi=3, lo=1))
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]      # 3-gram [1 2 3]
    assert p.propose([7, 1, 2, 8, 1, 2]) == [8, 1, 2]
    assert p.propose([5, 6, 7]) == []                                # nothing repeats
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], k=1) == [4]
    # The longest n-gram wins over a later, shorter match: [4 2] occurs late, [3 4 2] early.
    assert p.propose([3, 4, 2, 7, 7, 4, 2, 8, 3, 4, 2]) == [7, 7, 4]
    # Latest occurrence with k tokens after it.
    assert p.propose([1, 2, 5, 5, 5, 1, 2, 6, 6, 6, 1, 2]) == [6, 6, 6]
    q = NgramProposer(cfg(k=2, hi=4, lo=2))
    assert q.propose([9, 1, 9, 2, 9]) == []                          # only 1-grams repeat
    assert q.propose([4, 9, 1, 5, 9, 1]) == [5, 9]


def brute_force(toks, k, n_max, n_min):
    """The rule spelled out: longest suffix n-gram (n_max >= n >= n_min) found earlier; the
    latest occurrence with k tokens after it, else the earliest; the k tokens after it."""
    L = len(toks)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        starts = [s for s in range(0, L - n) if toks[s:s + n] == toks[L - n:]]
        if starts:
            full = [s for s in starts if s + n + k <= L]
            s = full[-1] if full else starts[0]
            return toks[s + n:s + n + k]
    return []


def test_proposer_matches_the_rule_spelled_out():
    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        k, lo = rng.randint(1, 6), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        toks = [rng.randint(0, rng.choice([2, 4, 30])) for _ in range(rng.randint(0, 40))]
        got = NgramProposer(cfg(k=k, hi=hi, lo=lo)).propose(toks)
        assert got == brute_force(toks, k, hi, lo), (toks, k, hi, lo)
        hits += bool(got)
    assert hits > 600  # most sequences have a match (small alphabets)


def run(seed, num_blocks, caching=True, block_size=4, budget=16, k=3):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, caching)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64),
                      cfg(k=k, hi=3, lo=1))
    reqs = []
    for g in range(6):
        p, mt, n = rng.randint(3, 20), rng.randint(1, 16), rng.choice([1, 1, 2])
        if -(-(p + mt) // block_size) > num_blocks - 1:
            continue
        sp = SamplingParams(n=n, max_tokens=mt, temperature=0, stop_token_ids=[3])
        ids = [rng.randint(0, 2) for _ in range(p)]
        kids = [Request(f"{j}_{g}", ids, sp, None, 0, sample_index=j) for j in range(n)]
        reqs += kids
        sched.add_request(kids[0], kids[1:])
    steps, drafted, rejected = 0, 0, 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < 3000, "no progress"
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget
        res = RunnerOutput()
        for s in out.scheduled:
            r = sched.requests[s.request_id]
            assert len(s.block_ids) * block_size >= s.num_computed_tokens + s.num_scheduled_tokens
            d = s.spec_token_ids
            if d:  # only decodes get drafts, within max_tokens and max_model_len
                assert s.token_ids[-len(d):] == d and r.num_tokens - s.num_computed_tokens == 1
                assert r.num_output_tokens + len(d) + 1 <= r.max_tokens
                assert s.num_computed_tokens + len(d) < 64
                drafted += 1
            if s.sample:
                a = rng.randint(0, len(d))
                last = rng.choice([t for t in range(4) if a == len(d) or t != d[a]])
                res.sampled[s.request_id] = d[:a] + [last]
                rejected += len(d) - a
        sched.update_from_output(out, res)
        for s in out.scheduled:
            r = sched.requests.get(s.request_id)
            if r is None or r.status != RequestStatus.RUNNING or not s.sample:
                continue
            assert r.num_computed_tokens == r.num_tokens - 1  # a decode's next position
            assert len(kv.get_block_ids(r.request_id)) == cdiv(r.num_computed_tokens, block_size)
        for r in sched.requests.values():  # hashed blocks hold the request's own tokens only
            parent = None
            for i, h in enumerate(r.block_hashes):
                parent = hash_block_tokens(parent, r.all_token_ids[i * block_size:(i + 1) * block_size])
                assert h == parent
        if rng.random() < 0.05 and sched.running:  # abort a whole request (all n samples)
            group = rng.choice(sched.running).request_id.split("_")[1]
            for r in reqs:
                if r.request_id.endswith("_" + group) and not r.status.is_finished:
                    sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == kv.num_total_blocks
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in range(1, num_blocks))
    for r in reqs:
        if r.status != RequestStatus.FINISHED_ABORTED:  # max_tokens or the stop token, never past
            assert r.num_output_tokens <= r.max_tokens
            assert 3 not in r.output_token_ids[:-1]
    return drafted, rejected, sched.num_preemptions, sched.spec_stats


@pytest.mark.parametrize("caching", [True, False])
def test_fuzz_drafts_no_leak_no_unwritten_hash(caching):
    drafted = rejected = preempted = 0
    for seed in range(120):
        for nb in (10, 16, 40):
            d, rj, p, stats = run(seed, nb, caching)
            drafted, rejected, preempted = drafted + d, rejected + rj, preempted + p
            assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
            assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert drafted > 500 and rejected > 500 and preempted > 0


def test_short_budget_drops_drafts_first():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=128),
                      cfg(k=3, hi=2, lo=1))
    reqs = [Request(f"r{i}", [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=10), None, 0) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step = lambda out: sched.update_from_output(  # noqa: E731 - every draft rejected
        out, RunnerOutput({s.request_id: [7] for s in out.scheduled if s.sample}))
    while any(r.num_output_tokens == 0 for r in reqs):
        out = sched.schedule()
        assert all(not s.spec_token_ids for s in out.scheduled if s.request_id != "r0")
        step(out)
    out = sched.schedule()  # three decodes, one token each; the token left buys one draft
    assert [s.num_scheduled_tokens for s in out.scheduled] == [2, 1, 1]
    r0 = out.scheduled[0]
    assert len(r0.spec_token_ids) == 1 and r0.token_ids == [7] + r0.spec_token_ids
    step(out)
    late = Request("late", list(range(10, 30)), SamplingParams(max_tokens=2), None, 0)
    sched.add_request(late)
    out = sched.schedule()  # a waiting prompt takes the token a draft would have had
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [
        ("r0", 1), ("r1", 1), ("r2", 1), ("late", 1)]
    assert not any(s.spec_token_ids for s in out.scheduled)


def test_cli_flag_reaches_the_engine_config():
    from jaxkv.cli import build_parser
    from jaxkv.engine_config import create_engine_config
    from jaxkv.models.model_config import ModelConfig
    from tests.runner.test_compilation import TINY_CONFIG

    for cmd in (["serve"], ["generate", "Hello"], ["plan"]):
        ns = build_parser().parse_args([*cmd, "--speculative-config",
                                        '{"method": "ngram", "num_speculative_tokens": 4, '
                                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'])
        args = EngineArgs.from_cli_args(ns)
        config = create_engine_config(args, platform="cpu",
                                      model_config=ModelConfig.from_hf_config(TINY_CONFIG))
        assert config.speculative == SpeculativeConfig("ngram", 4, 4, 2)


def test_more_drafts_than_the_budget_is_refused():
    from jaxkv.engine_config import create_engine_config
    from jaxkv.models.model_config import ModelConfig
    from tests.runner.test_compilation import TINY_CONFIG

    args = EngineArgs(max_num_batched_tokens=32, max_num_seqs=8,
                      speculative_config={"num_speculative_tokens": 32})
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(32\) must be less than max_num_batched_tokens \(32\)"):
        create_engine_config(args, platform="cpu", model_config=ModelConfig.from_hf_config(TINY_CONFIG))


def test_disable_by_batch_size():
    kv = KVCacheManager(64, 4)
    c = SpeculativeConfig.from_value({"num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                      "prompt_lookup_min": 1, "disable_by_batch_size": 3})
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128), c)
    reqs = [Request(f"r{i}", [5, 6, 5, 6], SamplingParams(max_tokens=8 + 4 * i), None, 0) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    drafted_with = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        drafted_with += [len(out.scheduled)] * any(s.spec_token_ids for s in out.scheduled)
        sched.update_from_output(out, RunnerOutput({s.request_id: [5] for s in out.scheduled if s.sample}))
    assert drafted_with and max(drafted_with) == 2  # three running: no drafts; two or one: drafts
def drain(sched, reject=True):
    while sched.has_unfinished_requests():
        out = sched.schedule()
        res = RunnerOutput()
        for s in out.scheduled:
            if s.sample:
                d = s.spec_token_ids
                res.sampled[s.request_id] = [9 if d and d[0] != 9 else 8] if reject else d + [5]
        sched.update_from_output(out, res)


def cached_hits_after_long_decode(spec):
    kv = KVCacheManager(64, 4)
    cfg = SpeculativeConfig.from_value({"num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                        "prompt_lookup_min": 1}) if spec else None
    sched = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256), cfg)
    prefix = list(range(100, 140))
    sched.add_request(Request("a", prefix, SamplingParams(max_tokens=1), None, 0))
    drain(sched)
    # One long decode whose drafts are always rejected (tokens 8/9 keep matching n-grams).
    sched.add_request(Request("b", [8, 9, 8, 9], SamplingParams(max_tokens=100), None, 0))
    drain(sched)
    again = Request("a2", prefix, SamplingParams(max_tokens=1), None, 0)
    return kv.get_computed_blocks(again)[1]


def test_rejected_drafts_do_not_evict_the_prefix_cache():
    """Blocks freed after rejected drafts go to the front of the free queue (found by review:
    at the back, a decode whose drafts keep failing walked through the queue evicting every
    cached prefix)."""
    without = cached_hits_after_long_decode(spec=False)
    with_spec = cached_hits_after_long_decode(spec=True)
    assert without == 36
    assert with_spec == without, "drafts evicted cached prefix blocks they never kept"
