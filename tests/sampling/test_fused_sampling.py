"""Fused sampling (jaxkv/sampling/fused_sampling.py): the step programs sample a plain step's
tokens themselves (greedy, random, top-k / top-p, seeded). The tokens must be the sampler's,
exactly: the same engine with the fusion turned off (its programs unchanged, every step then
sampled by the separate sampler programs, which the HF parity and seeded-sampling tests
check) gives the same tokens, with and without async scheduling, and steps holding any row
that needs more than the tokens (logprobs, penalties) are not fused."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.core.scheduler_output import ScheduledRequest
from jaxkv.sampling import fused_sampling as fs

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "List three prime numbers:",
           "Once upon a time, a robot"]
ENGINE = dict(max_model_len=512, max_num_batched_tokens=256, token_buckets=(1, 4, 256),
              max_num_seqs=4, kv_cache_memory_bytes=32 << 20)
PLAIN = {"greedy": dict(temperature=0),
         "random": dict(temperature=0.9, seed=7),
         "filtered": dict(temperature=0.8, top_k=40, top_p=0.9, seed=5)}


@pytest.fixture(scope="module")
def small_llm():
    from jaxkv import LLM
    return LLM(**ENGINE)


def _generate(llm, prompts, params, *, fused: bool, async_on: bool):
    runner = llm.llm_engine.runner
    saved = runner.fused_sampling_max_tokens, runner.async_scheduling
    runner.fused_sampling_max_tokens = saved[0] if fused else 0  # the programs stay the same
    runner.async_scheduling = async_on
    try:
        before = runner.num_fused_sampling_steps
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, runner.num_fused_sampling_steps - before
    finally:
        runner.fused_sampling_max_tokens, runner.async_scheduling = saved


@pytest.mark.parametrize("async_on", [False, True])
@pytest.mark.parametrize("mode", list(PLAIN))
@pytest.mark.parametrize("n", [1, 4])
def test_fused_sampling_gives_the_samplers_tokens(small_llm, n, mode, async_on):
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **PLAIN[mode])
    fused, n_fused = _generate(small_llm, PROMPTS[:n], sp, fused=True, async_on=async_on)
    plain, n_plain = _generate(small_llm, PROMPTS[:n], sp, fused=False, async_on=async_on)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.outputs[0].token_ids) == 24 for o in fused)
    assert n_fused >= 24 and n_plain == 0  # every step fused, the prompts' one included
    s = small_llm.stats()
    assert s.fused_sampling_max_tokens == fs.NO_LIMIT and s.num_fused_sampling_steps >= n_fused


def test_a_step_of_mixed_plain_modes_fuses_and_keeps_each_rows_tokens(small_llm):
    """Greedy, random and filtered rows in one step (the filtered mode): each row's tokens are
    its own, as when the sampler programs run them."""
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **PLAIN[m]) for m in PLAIN]
    params.append(SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=16, ignore_eos=True))
    fused, n_fused = _generate(small_llm, PROMPTS, params, fused=True, async_on=True)
    plain, _ = _generate(small_llm, PROMPTS, params, fused=False, async_on=True)
    assert n_fused >= 16
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]


def test_steps_with_rows_that_need_the_sampler_are_not_fused(small_llm):
    mixed = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, logprobs=2, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True)]
    for params in (mixed, mixed[2:3], mixed[3:4]):
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
    assert fs.fusable([g], 1, 4) and fs.fusable([g, _req(1)], 4, 4)
    assert not fs.fusable([g], 8, 4)                       # a bucket without the output
    assert not fs.fusable([g], 1, 0)                       # fusion off (tensor parallelism)
    assert not fs.fusable([_req(sample=False)], 1, 4)      # nothing samples (a prompt chunk)
    assert fs.fusable([_req(sample=False), g], 4, 4)       # a chunk next to a decode
    assert fs.fusable([g, _req(1, sp=SamplingParams(temperature=0.5, top_k=3, seed=1))], 4, 4)
    for other in (_req(sp=SamplingParams(temperature=0, logprobs=1)),
                  _req(sp=SamplingParams(temperature=0.5, presence_penalty=0.5)),
                  _req(sp=SamplingParams(temperature=0, logit_bias={3: 1.0})),
                  _req(sp=SamplingParams(temperature=0, min_tokens=4), min_tokens_banned_ids=[2]),
                  _req(spec_token_ids=[4], token_ids=[5, 4]),
                  _req(grammar_bitmask=[0])):
        assert not fs.fusable([g, other], 4, 4), other
    assert fs.max_tokens(1) == fs.NO_LIMIT and fs.max_tokens(2) == 0
    # sequence i's token is row i of the fused output (its logits_indices entry)
    spans = fs.spans([_req(0, sample=False), _req(1), _req(2)])
    assert [(s.sched.request_id, s.row, s.count) for s in spans] == [("r1", 1, 1), ("r2", 2, 1)]


def test_the_mode_is_the_separate_samplers():
    def mode(*sps):
        return int(fs.mode_index(fs.spans([_req(i, sp=sp) for i, sp in enumerate(sps)]))[0])
    greedy, rand = SamplingParams(temperature=0), SamplingParams(temperature=0.5)
    assert mode(greedy, greedy) == 1
    assert mode(greedy, rand) == 2
    assert mode(rand, SamplingParams(temperature=0.5, top_p=0.8)) == 3
    assert mode(greedy, SamplingParams(temperature=0, top_k=5)) == 1  # greedy ignores top_k
