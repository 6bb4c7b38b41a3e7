"""Multi-step decode (jaxkv/runner/multi_step.py, --num-scheduler-steps): up to k decode steps
in one program must give single-step decoding's tokens, text and finish reasons exactly
(greedy, seeded random, top-k / top-p; stops by EOS, stop ids, stop strings and max_tokens
inside the k steps; n > 1; arrivals; a pool small enough to preempt), never emit a token past
a stop, and give every block back."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.runner.input_builder import build_step_input
from jaxkv.runner.multi_step import plan_arrays
from jaxkv.core.scheduler_output import ScheduledRequest, SchedulerOutput

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "List three prime numbers:",
           "Once upon a time, a robot", "def fibonacci(n):", "Hello"]
ENGINE = dict(max_model_len=256, max_num_batched_tokens=128, token_buckets=(1, 4, 8, 128),
              max_num_seqs=8, kv_cache_memory_bytes=32 << 20)
K = 4


@pytest.fixture(scope="module")
def pair():
    from jaxkv import LLM
    return LLM(**ENGINE), LLM(num_scheduler_steps=K, **ENGINE)


def _outs(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _check(pair, prompts, params, min_multi: int = 1):
    single, multi = pair
    before = multi.stats().num_multi_steps
    want, got = _outs(single, prompts, params), _outs(multi, prompts, params)
    assert got == want
    assert multi.stats().num_multi_steps - before >= min_multi
    kv = multi.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks  # every block back
    return got


@pytest.mark.parametrize("params", [
    dict(temperature=0),
    dict(temperature=0.9, seed=7),
    dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05, seed=5),
], ids=["greedy", "random", "filtered"])
def test_multi_step_gives_the_single_step_tokens(pair, params):
    sps = [SamplingParams(max_tokens=m, ignore_eos=True, **params) for m in (1, 2, 5, 13, 17, 30)]
    _check(pair, PROMPTS, sps, min_multi=3)


def test_steady_multi_steps_are_dispatched_ahead(pair):
    """Async scheduling goes on through multi-steps: each k-step program after the first is
    dispatched before the last one's tokens reach the host, its next steps predicted as the
    scheduler gives them (lookahead slots of k), from the launcher's thread."""
    _, multi = pair
    s0 = multi.stats()
    _check(pair, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=41, ignore_eos=True))
    s = multi.stats()
    assert s.num_steps - s0.num_steps == 11  # the prompts' step, then 10 steps of 4 tokens
    assert s.num_multi_steps - s0.num_multi_steps == 10
    assert s.num_async_steps_used - s0.num_async_steps_used == 10
    assert s.num_async_steps_discarded == s0.num_async_steps_discarded
    # each from the launcher's thread (jaxkv/runner/launcher.py), the last one discarded or
    # not yet taken when the requests end
    assert s.num_launched_steps - s0.num_launched_steps == s.num_async_steps - s0.num_async_steps >= 10


def test_the_k_step_programs_compile_with_their_buckets(pair):
    """Warmup and the background compiler compile each decode bucket's k-step program (both
    decode_only variants where the backend has them): steady multi-steps compile nothing."""
    _, multi = pair
    eng = multi.llm_engine
    assert eng.wait_for_background_compile(300)
    runner = eng.runner
    assert {t for t, _ in runner.multi_step.compiled} == {1, 4, 8}  # max_num_seqs 8: bucket 8
    before = eng.stats().num_compilations
    _check(pair, PROMPTS, SamplingParams(temperature=0.7, seed=2, max_tokens=21, ignore_eos=True))
    assert eng.stats().num_compilations == before


def test_arrivals_run_beside_the_multi_steps_run_ahead(pair):
    """More prompts than seats: each admission step runs the new prompt as a program of its
    own beside the decodes' k-step program taken from the step run ahead, so no step run
    ahead is discarded and the chain goes on."""
    _, multi = pair
    s0 = multi.stats()
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 14, 22, 5, 17, 30)]
    _check(pair, PROMPTS * 2, sps * 2, min_multi=5)
    s = multi.stats()
    assert s.num_async_steps_discarded == s0.num_async_steps_discarded
    assert s.num_async_steps_used - s0.num_async_steps_used >= 5


def test_stops_inside_the_k_steps_emit_nothing_after_them(pair):
    """EOS (not ignored), a stop token id and stop strings that land inside a multi-step."""
    single, _ = pair
    ref = _outs(single, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    sps = [SamplingParams(temperature=0, max_tokens=40),  # the model's own EOS, if it comes
           SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ref[1][0][0][6]]),
           SamplingParams(temperature=0, max_tokens=40, stop=[ref[2][0][1][5:9]])]
    got = _check(pair, PROMPTS[:3], sps)
    assert got[1][0][2] == "stop" and len(got[1][0][0]) <= 7
    assert got[2][0][2] == "stop" and ref[2][0][1][5:9] not in got[2][0][1]


def test_n_samples_arrivals_and_a_preempting_pool(pair):
    sps = [SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=19, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)]
    _check(pair, PROMPTS[:2], sps)
    from jaxkv import LLM
    small = dict(ENGINE, kv_cache_memory_bytes=None, num_gpu_blocks_override=10)
    tight = (LLM(**small), LLM(num_scheduler_steps=K, **small))
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _check(tight, PROMPTS[:4], sp)
    assert tight[1].stats().num_preemptions > 0


def test_steps_that_need_the_host_stay_single(pair):
    single, multi = pair
    for sp in (SamplingParams(temperature=0, max_tokens=9, logprobs=2),
               SamplingParams(temperature=0.5, seed=1, max_tokens=9, repetition_penalty=1.2),
               SamplingParams(temperature=0, max_tokens=9, min_tokens=9, ignore_eos=False)):
        before = multi.stats().num_multi_steps
        a, b = single.generate(PROMPTS[:2], sp, use_tqdm=False), multi.generate(PROMPTS[:2], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        if sp.logprobs:
            assert [o.outputs[0].logprobs for o in a] == [o.outputs[0].logprobs for o in b]
        assert multi.stats().num_multi_steps == before, sp


def test_plan_arrays_send_a_finished_rows_kv_to_the_null_block():
    rt = (np.arange(64, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32),) * 2
    s = [ScheduledRequest(f"r{i}", [5], c, blocks, True, SamplingParams(), 0, 0, 1, num_steps=m)
         for i, (c, blocks, m) in enumerate([(14, [3, 7], 3), (5, [9], 1)])]
    si = build_step_input(SchedulerOutput(s), block_size=16, num_tokens=4, rows=4, max_blocks=4,
                          rope_table=rt)
    p = plan_arrays(si, np.array([3, 1]), 3, 16, rt)
    assert p.positions[:, :2].tolist() == [[14, 5], [15, 5], [16, 5]]
    assert p.slot_mapping[:, :2].tolist() == [[3 * 16 + 14, 9 * 16 + 5], [3 * 16 + 15, 0], [7 * 16, 0]]
    assert p.seq_lens[:, :2].tolist() == [[15, 6], [16, 6], [17, 6]]
    assert p.slot_mapping[:, 2:].tolist() == [[0, 0]] * 3 and p.rope_cos[2, 0, 0] == 16


def test_the_flag_is_validated_and_counted():
    from jaxkv.engine_args import EngineArgs
    for bad in (0, -1, 1.5, True, 65, 10**9):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            EngineArgs(num_scheduler_steps=bad)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(num_scheduler_steps=4, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineArgs(num_scheduler_steps=4, speculative_config={"method": "ngram",
                                                              "num_speculative_tokens": 2})
