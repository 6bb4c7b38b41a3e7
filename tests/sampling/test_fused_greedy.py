"""Fused greedy sampling (jaxkv/sampling/fused_greedy.py): the step programs of the smallest
token buckets take a plain greedy step's argmax themselves. The tokens must be the sampler's,
exactly: the same engine with the fusion turned off (its programs unchanged, every step then
sampled by the separate sampler programs, which the HF parity tests check) gives the same
tokens, with and without async scheduling, and steps holding any row that needs more than
the argmax (random sampling, logprobs, penalties) are not fused."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.core.scheduler_output import ScheduledRequest
from jaxkv.sampling import fused_greedy as fg

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "List three prime numbers:",
           "Once upon a time, a robot"]
# Buckets 1 and 4 have the fused output (cpu backend: up to MAX_ROWS_TRANSPOSED = 4 rows);
# 256 holds the prompts.
ENGINE = dict(max_model_len=512, max_num_batched_tokens=256, token_buckets=(1, 4, 256),
              max_num_seqs=4, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def small_llm():
    from jaxkv import LLM
    return LLM(**ENGINE)


def _generate(llm, prompts, params, *, fused: bool, async_on: bool):
    runner = llm.llm_engine.runner
    saved = runner.fused_greedy_max_tokens, runner.async_scheduling
    runner.fused_greedy_max_tokens = saved[0] if fused else 0  # the programs stay the same
    runner.async_scheduling = async_on
    try:
        before = runner.num_fused_greedy_steps
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, runner.num_fused_greedy_steps - before
    finally:
        runner.fused_greedy_max_tokens, runner.async_scheduling = saved


@pytest.mark.parametrize("async_on", [False, True])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_fused_greedy_gives_the_samplers_tokens(small_llm, n, async_on):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fused, n_fused = _generate(small_llm, PROMPTS[:n], sp, fused=True, async_on=async_on)
    plain, n_plain = _generate(small_llm, PROMPTS[:n], sp, fused=False, async_on=async_on)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.outputs[0].token_ids) == 24 for o in fused)
    # every decode step fused (the prompts' step samples too, in bucket 256: not fused)
    assert n_fused >= 23 and n_plain == 0
    s = small_llm.stats()
    assert s.fused_greedy_max_tokens == 4 and s.num_fused_greedy_steps >= n_fused


def test_steps_with_rows_that_need_the_sampler_are_not_fused(small_llm):
    mixed = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True)]
    for params in (mixed, mixed[1:2], mixed[2:3], mixed[3:4]):
        prompts = PROMPTS[:len(params)]
        fused, n_fused = _generate(small_llm, prompts, params, fused=True, async_on=True)
        plain, _ = _generate(small_llm, prompts, params, fused=False, async_on=True)
        assert n_fused == 0, params
        for a, b in zip(fused, plain):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            if a.outputs[0].logprobs is not None:
                assert a.outputs[0].logprobs == b.outputs[0].logprobs


def _req(i=0, **kw):
    sp = kw.pop("sp", SamplingParams(temperature=0))
    base = dict(request_id=f"r{i}", token_ids=[5], num_computed_tokens=7, block_ids=[1],
                sample=True, sampling_params=sp, seed=0, sample_index=0, num_output_tokens=1)
    return ScheduledRequest(**{**base, **kw})


def test_which_steps_fuse():
    g = _req()
    assert fg.fusable([g], 1, 4) and fg.fusable([g, _req(1)], 4, 4)
    assert not fg.fusable([g], 8, 4)                       # a bucket without the output
    assert not fg.fusable([g], 1, 0)                       # fusion off (xla backend, TP)
    assert not fg.fusable([_req(sample=False)], 1, 4)      # nothing samples (a prompt chunk)
    assert fg.fusable([_req(sample=False), g], 4, 4)       # a chunk next to a greedy decode
    for other in (_req(sp=SamplingParams(temperature=0.5)),
                  _req(sp=SamplingParams(temperature=0, logprobs=1)),
                  _req(sp=SamplingParams(temperature=0, presence_penalty=0.5)),
                  _req(sp=SamplingParams(temperature=0, logit_bias={3: 1.0})),
                  _req(sp=SamplingParams(temperature=0, min_tokens=4), min_tokens_banned_ids=[2]),
                  _req(spec_token_ids=[4], token_ids=[5, 4]),
                  _req(grammar_bitmask=[0])):
        assert not fg.fusable([g, other], 4, 4), other
    # sequence i's token is row i of the fused output (its logits_indices entry)
    spans = fg.spans([_req(0, sample=False), _req(1), _req(2)])
    assert [(s.sched.request_id, s.row, s.count) for s in spans] == [("r1", 1, 1), ("r2", 2, 1)]
