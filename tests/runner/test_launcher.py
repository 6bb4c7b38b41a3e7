"""The step run ahead is dispatched from the launcher's thread (jaxkv/runner/launcher.py):
calls run in order on one worker thread, an error waits for the next join, and the engine's
outputs are those of synchronous scheduling, also when a launched step fails."""

from __future__ import annotations

import logging
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


def _reference_then_fail(llm, monkeypatch, after_call: bool):
    """The synchronous engine's outputs of 4 greedy requests (logprobs for the margins), then
    the third launched step made to fail (`_fail_third_launch`) and the requests added to
    the engine with async scheduling on."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 20, 7, 15)]
    monkeypatch.setattr(runner, "async_scheduling", False)
    ref = llm.generate(PROMPTS[:4], [SamplingParams(temperature=0, max_tokens=p.max_tokens, logprobs=2)
                                     for p in params], use_tqdm=False)
    monkeypatch.setattr(runner, "async_scheduling", True)
    _fail_third_launch(monkeypatch, runner, after_call)
    for i, (p, sp) in enumerate(zip(PROMPTS[:4], params)):
        engine.add_request(str(i), p, sp)
    return ref


def _fail_third_launch(monkeypatch, runner, after_call: bool):
    """The third step program called on the launcher's thread raises, before or after the
    program ran (after: the pool it was given is donated, and its successor is lost)."""
    real, calls = runner._run_step, []

    def run_step(*args):
        calls.append(threading.current_thread().name)
        third = calls.count("jaxkv-dispatch_0") == 3 and calls[-1] == "jaxkv-dispatch_0"
        if third and not after_call:
            raise RuntimeError("injected launched-step failure")
        out = real(*args)
        if third:
            raise RuntimeError("injected launched-step failure")
        return out
    monkeypatch.setattr(runner, "_run_step", run_step)


def _finish(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return done


def test_a_launched_step_that_fails_leaving_the_pool_runs_its_sequences_in_line(llm, monkeypatch, caplog):
    """The error of a step dispatched from the launcher's thread is found when the engine
    takes that step's results (its next step); the pool intact, that step runs those
    sequences in line (a warning is logged) and every token is the synchronous engine's."""
    engine = llm.llm_engine
    discarded = engine.stats().num_async_steps_discarded
    ref = _reference_then_fail(llm, monkeypatch, after_call=False)
    log = logging.getLogger("jaxkv")  # it does not propagate to the root logger caplog watches
    log.addHandler(caplog.handler)
    try:
        done = _finish(engine)  # no error reaches the caller
    finally:
        log.removeHandler(caplog.handler)
    assert [done[str(i)] for i in range(4)] == [o.outputs[0].token_ids for o in ref]
    assert "a step run ahead failed to dispatch" in caplog.text
    assert engine.stats().num_async_steps_discarded == discarded + 1
    assert _idle(llm)


def test_a_launched_step_that_fails_taking_the_pool_is_undone_at_the_next_step(llm, monkeypatch):
    """A launched call that fails after its program took the pool (donated) leaves no pool:
    the next step raises and is undone, the pool is reallocated, every request recomputes
    and ends as it would have, and every block comes back."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    ref = _reference_then_fail(llm, monkeypatch, after_call=True)
    with pytest.raises(RuntimeError, match="injected launched-step"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not runner.launcher.busy
    done = _finish(engine)
    for i, o in enumerate(ref):  # (recomputed K/V: equal tokens, or a near tie after one)
        assert_same_or_near_tie(done[str(i)], o.outputs[0].token_ids,
                                margins_from_logprobs(o.outputs[0].logprobs), what=str(i))
    assert _idle(llm)


def test_an_interrupted_join_keeps_the_call_pending():
    """Ctrl-C while the engine thread waits for the call in flight: the call stays pending,
    and the next join waits for it (the pool is never used while a call may donate it)."""
    import time
    launcher, started, release = Launcher(), threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(5)
        return "done"
    future = launcher.launch(slow)
    started.wait(5)
    real = future.exception
    future.exception = lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())  # the wait, interrupted
    with pytest.raises(KeyboardInterrupt):
        launcher.join()
    future.exception = real
    assert launcher.busy
    threading.Timer(0.2, release.set).start()
    t0 = time.perf_counter()
    launcher.join()
    assert time.perf_counter() - t0 > 0.1 and future.result() == "done" and not launcher.busy
    launcher.shutdown()
