"""A step that raises commits nothing: no block it left unwritten is ever served from the prefix
cache afterwards (handed case C2 of 2026-11-30)."""

from __future__ import annotations

import jax
import pytest

from jaxkv import SamplingParams
from tests.engine.conftest import _idle, _unique_prompt
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs


def _reference(llm_no_prefix_cache, prompt):
    sp = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    o = llm_no_prefix_cache.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    return o.token_ids, margins_from_logprobs(o.logprobs)


def _fail_once(monkeypatch, obj, name, exc=RuntimeError("injected step failure"), after=0,
               before_call=True):
    """Make obj.name raise once, on its (after+1)-th call; before or after the real call."""
    real, calls = getattr(obj, name), [0]

    def wrapper(*a, **kw):
        calls[0] += 1
        if calls[0] == after + 1:
            if before_call:
                raise exc
            real(*a, **kw)
            raise exc
        return real(*a, **kw)
    monkeypatch.setattr(obj, name, wrapper)
    return calls


def _check_recovered(llm, llm_no_prefix_cache, prompt, expect_cached):
    assert _idle(llm)
    ref, margins = _reference(llm_no_prefix_cache, prompt)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert out.num_cached_tokens == expect_cached
    assert_same_or_near_tie(out.outputs[0].token_ids, ref, margins, what="after a failed step")


def test_c2_case_as_written_runner_raises_once(llm, llm_no_prefix_cache, monkeypatch):
    prompt = _unique_prompt(1, 60)  # 3 full blocks and a bit
    _fail_once(monkeypatch, llm.llm_engine.runner, "execute")
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    monkeypatch.undo()
    _check_recovered(llm, llm_no_prefix_cache, prompt, expect_cached=0)


def test_ctrl_c_in_generate(llm, llm_no_prefix_cache, monkeypatch):
    prompt = _unique_prompt(2, 70)
    _fail_once(monkeypatch, llm.llm_engine.runner, "execute", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    monkeypatch.undo()
    _check_recovered(llm, llm_no_prefix_cache, prompt, expect_cached=0)


def test_failure_in_the_sampler_program(llm, llm_no_prefix_cache, monkeypatch):
    # The model step ran (K/V written) but sampling raised: still nothing is trusted. (A
    # request with logprobs: a plain one samples inside the step program, fused_sampling.py.)
    prompt = _unique_prompt(3, 50)
    _fail_once(monkeypatch, llm.llm_engine.runner.programs, "sample")
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logprobs=1), use_tqdm=False)
    monkeypatch.undo()
    _check_recovered(llm, llm_no_prefix_cache, prompt, expect_cached=0)


def test_failure_in_the_middle_of_a_chunked_prefill(llm, llm_no_prefix_cache, monkeypatch):
    # Budget 256: chunks of 256, 256, 88. The first chunk's step ran, the second's raised:
    # only the first chunk's 16 blocks may be served afterwards.
    prompt = _unique_prompt(4, 600)
    calls = _fail_once(monkeypatch, llm.llm_engine.runner, "execute", after=1)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert calls[0] == 2
    monkeypatch.undo()
    _check_recovered(llm, llm_no_prefix_cache, prompt, expect_cached=256)


def test_step_that_consumed_the_pool_then_raised(llm, llm_no_prefix_cache, monkeypatch):
    # The jitted step ran with the pool donated, then the call raised: the old pool is gone.
    # The engine keeps running the other requests (they recompute) and serves nothing stale.
    engine = llm.llm_engine
    survivor = _unique_prompt(5, 40)
    engine.add_request("survivor", survivor, SamplingParams(temperature=0, max_tokens=10))
    for _ in range(3):
        engine.step()  # the survivor's prompt is computed and cached; it is decoding
    prompt = _unique_prompt(6, 60)
    engine.add_request("victim", prompt, SamplingParams(temperature=0, max_tokens=10))
    _fail_once(monkeypatch, engine.runner, "_run_step", before_call=False)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(2):  # with async scheduling, the survivor's next decode may have run
            engine.step()   # ahead (no step program now) and the victim joins the step after
    assert all(a.is_deleted() is False for a in jax.tree.leaves(engine.runner.kv_cache))
    monkeypatch.undo()
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done["victim"].num_cached_tokens == 0
    for rid, p in (("survivor", survivor), ("victim", prompt)):
        ref, margins = _reference(llm_no_prefix_cache, p)
        assert_same_or_near_tie(done[rid].outputs[0].token_ids, ref, margins, what=rid)
    _check_recovered(llm, llm_no_prefix_cache, survivor, expect_cached=32)  # computed anew
