"""The step run ahead is dispatched from the launcher's thread (jaxkv/runner/launcher.py):
calls run in order on one worker thread, an error waits for the next join, and the engine's
outputs are those of synchronous scheduling, also when a launched step fails."""

from __future__ import annotations

import threading

import pytest

from jaxkv import SamplingParams
from jaxkv.runner.launcher import Launcher
from tests.engine.conftest import _idle
from tests.engine.test_async_scheduling import PROMPTS
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs


def test_calls_run_in_order_on_one_worker_thread():
    launcher, seen = Launcher(), []
    futures = [launcher.launch(lambda i: seen.append((i, threading.current_thread().name)) or i, i)
               for i in range(50)]
    assert launcher.busy
    launcher.join()
    assert not launcher.busy
    assert [f.result() for f in futures] == list(range(50))  # every call done by the last join
    assert [i for i, _ in seen] == list(range(50))
    assert len({name for _, name in seen}) == 1
    assert seen[0][1].startswith("jaxkv-dispatch") and seen[0][1] != threading.current_thread().name
    assert launcher.num_launched == 50
    launcher.shutdown()


def test_an_error_is_raised_once_by_the_next_join():
    launcher = Launcher()
    launcher.launch(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        launcher.join()
    launcher.join()  # raised once
    launcher.launch(lambda: 1 / 0)
    launcher.join(raise_error=False)  # dropped
    launcher.shutdown()


def _generate(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]


def test_steps_run_ahead_are_launched_off_the_engine_thread(llm, monkeypatch):
    runner = llm.llm_engine.runner
    assert runner.launcher is not None  # one device, async scheduling on
    threads, real = [], runner.forward

    def forward(si):
        threads.append(threading.current_thread().name)
        return real(si)
    monkeypatch.setattr(runner, "forward", forward)
    params = [SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(temperature=0.8, seed=5, max_tokens=20),
              SamplingParams(temperature=0.7, seed=9, top_p=0.9, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=8)]
    before = llm.llm_engine.stats()
    got = _generate(llm, params)
    after = llm.llm_engine.stats()
    launched = after.num_launched_steps - before.num_launched_steps
    assert launched >= 10 and threads.count("jaxkv-dispatch_0") == launched
    assert threads.count(threading.current_thread().name) >= 1  # the prompts: in line
    monkeypatch.setattr(runner, "async_scheduling", False)
    assert got == _generate(llm, params)
    assert _idle(llm)


def test_a_launched_step_that_fails_is_undone_at_the_next_step(llm, monkeypatch):
    """The error of a step dispatched from the launcher's thread surfaces when the engine
    takes that step's results (its next step), which is undone: its requests recompute and
    end as they would have, and every block comes back."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 20, 7, 15)]
    monkeypatch.setattr(runner, "async_scheduling", False)
    ref = llm.generate(PROMPTS[:4], [SamplingParams(temperature=0, max_tokens=p.max_tokens, logprobs=2)
                                     for p in params], use_tqdm=False)
    monkeypatch.setattr(runner, "async_scheduling", True)
    real, calls = runner._fused_step, []

    def fused_step(si):
        calls.append(threading.current_thread().name)
        if calls.count("jaxkv-dispatch_0") == 3 and calls[-1] == "jaxkv-dispatch_0":
            raise RuntimeError("injected launched-step failure")
        return real(si)
    monkeypatch.setattr(runner, "_fused_step", fused_step)
    for i, (p, sp) in enumerate(zip(PROMPTS[:4], params)):
        engine.add_request(str(i), p, sp)
    with pytest.raises(RuntimeError, match="injected launched-step"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not runner.launcher.busy
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    for i, o in enumerate(ref):  # (recomputed K/V: equal tokens, or a near tie after one)
        assert_same_or_near_tie(done[str(i)], o.outputs[0].token_ids,
                                margins_from_logprobs(o.outputs[0].logprobs), what=str(i))
    assert _idle(llm)
