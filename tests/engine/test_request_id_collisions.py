"""No two live requests or n>1 samples share an internal id: an add that would collide is a
ValueError naming the id, and the engine keeps running (handed case C3 of 2026-11-30)."""

from __future__ import annotations

import asyncio

import pytest

from jaxkv import SamplingParams
from jaxkv.engine.async_llm import AsyncLLM
from tests.engine.conftest import _idle


def test_c3_case_as_written(llm):
    engine = llm.llm_engine
    engine.add_request("0_x", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="'x'.*'0_x'"):
        engine.add_request("x", [8, 9], SamplingParams(n=2, max_tokens=4))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["0_x"] and _idle(llm)


def test_sample_id_taken_first_and_the_same_user_id_twice(llm):
    engine = llm.llm_engine
    engine.add_request("y", [8, 9], SamplingParams(n=3, max_tokens=3))
    for bad in ("2_y", "y"):
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(bad, [5, 6, 7], SamplingParams(max_tokens=2))
    engine.add_request("3_y", [5, 6, 7], SamplingParams(max_tokens=2))  # not a sample of y
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(out) == ["3_y", "y"] and len(out["y"].outputs) == 3 and _idle(llm)
    engine.add_request("2_y", [5, 6], SamplingParams(max_tokens=1))  # free again once y ended
    while engine.has_unfinished_requests():
        engine.step()


def test_async_adds_that_collide_before_the_engine_thread_sees_them(llm):
    engine = llm.llm_engine
    a = AsyncLLM(engine, log_stats=False)

    async def run():
        s1 = await a.add_request("0_z", [5, 6, 7], SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="already in use"):
            await a.add_request("z", [8, 9], SamplingParams(n=2, max_tokens=3))
        outs = [o async for o in s1]
        s2 = await a.add_request("z", [8, 9], SamplingParams(n=2, max_tokens=3))
        outs2 = [o async for o in s2]
        return outs[-1], outs2[-1]

    try:
        first, second = asyncio.run(run())
    finally:
        a.shutdown()
    assert first.finished and second.finished and len(second.outputs) == 2
    assert a.dead is not None and "shut down" in str(a.dead)  # died only from the shutdown
    assert _idle(llm)
