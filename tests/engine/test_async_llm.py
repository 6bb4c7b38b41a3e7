"""AsyncLLM: the engine on its own thread, async output streams, aborts that free blocks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxkv.engine.async_llm import AsyncLLM, EngineDeadError
from jaxkv.sampling.params import RequestOutputKind, SamplingParams


@pytest.fixture
def async_llm(llm):
    """An AsyncLLM around the session engine; shut down (thread joined) after the test, and
    the engine must then hold no request and no block."""
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    a = AsyncLLM(engine, log_stats=False)
    yield a
    a.shutdown()
    assert not engine.has_unfinished_requests()
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def _greedy(n, kind=RequestOutputKind.DELTA, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind, **kw)


def test_delta_stream_joins_to_the_offline_result(llm, async_llm):
    prompt = "The three primary colors are"
    ref = llm.generate(prompt, _greedy(12, RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0].outputs[0]

    async def run():
        ids, text, finished = [], "", []
        async for out in async_llm.generate(prompt, _greedy(12), request_id="a"):
            c = out.outputs[0]
            ids += c.token_ids
            text += c.text
            finished.append(out.finished)
        return ids, text, finished

    ids, text, finished = asyncio.run(run())
    assert ids == ref.token_ids and text == ref.text
    assert finished[-1] and not any(finished[:-1])


def test_steps_run_off_the_event_loop_and_the_loop_stays_responsive(async_llm):
    engine = async_llm.engine
    step_threads, real_step = [], engine.engine_core_step

    def slow_step():  # make every step take long enough that a blocked loop would show
        step_threads.append(threading.get_ident())
        time.sleep(0.05)
        return real_step()

    engine.engine_core_step = slow_step
    try:
        async def run():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.005)
                    ticks += 1

            t = asyncio.create_task(ticker())
            t0 = time.monotonic()
            outs = [o async for o in async_llm.generate("Hello", _greedy(8), request_id="b")]
            elapsed = time.monotonic() - t0
            t.cancel()
            return outs, ticks, elapsed, threading.get_ident()

        outs, ticks, elapsed, loop_thread = asyncio.run(run())
    finally:
        del engine.engine_core_step
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 8
    assert len(step_threads) >= 8 and loop_thread not in step_threads
    # Each step sleeps 50 ms: a loop blocked by the steps would tick about once per step; a
    # free one ticks every 5 ms, i.e. several times per step.
    assert ticks >= 3 * len(step_threads), (ticks, len(step_threads), elapsed)


def test_concurrent_requests_all_finish_with_their_own_outputs(llm, async_llm):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    refs = [o.outputs[0].token_ids for o in
            llm.generate(prompts, _greedy(6, RequestOutputKind.FINAL_ONLY), use_tqdm=False)]

    async def one(i):
        ids = []
        async for out in async_llm.generate(prompts[i], _greedy(6), request_id=f"c{i}"):
            ids += out.outputs[0].token_ids
        return ids

    async def run():
        return await asyncio.gather(*(one(i) for i in range(6)))

    assert asyncio.run(run()) == refs


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(async_llm):
    async def run():
        gen = async_llm.generate("Once upon a time " * 20, _greedy(400), request_id="d")
        seen = [await gen.__anext__() for _ in range(3)]
        in_use = async_llm.stats().num_total_blocks - async_llm.stats().num_free_blocks
        await gen.aclose()
        for _ in range(200):  # the engine thread applies the abort before its next step
            s = async_llm.stats()
            if s.num_running == 0 and s.num_free_blocks == s.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        return seen, in_use, async_llm.stats()

    seen, in_use, s = asyncio.run(run())
    assert len(seen) == 3 and not seen[-1].finished
    assert in_use > 0
    assert s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


def test_bad_input_raises_at_once_and_queues_nothing(async_llm):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await async_llm.add_request("e", "hi", _greedy(5000))
        with pytest.raises(ValueError, match="vocabulary"):
            await async_llm.add_request("e", {"prompt_token_ids": [1, 10**7]}, _greedy(4))
        stream = await async_llm.add_request("e", "hi", _greedy(2))  # the id is still free
        with pytest.raises(ValueError, match="already in use"):
            await async_llm.add_request("e", "hi", _greedy(2))
        return [o async for o in stream]

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].request_id == "e"


def test_a_failing_step_ends_every_stream_and_refuses_new_requests(llm):
    engine = llm.llm_engine
    real_step, calls = engine.engine_core_step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.engine_core_step = failing_step
    a = AsyncLLM(engine, log_stats=False)
    try:
        async def run():
            streams = [await a.add_request(f"h{i}", "Tell me a story", _greedy(50)) for i in range(2)]
            for s in streams:
                with pytest.raises(EngineDeadError, match="device lost"):
                    async for _ in s:
                        pass
            with pytest.raises(EngineDeadError):
                await a.add_request("h9", "hi", _greedy(2))

        asyncio.run(run())
        a._thread.join(10)
        assert not a._thread.is_alive()
    finally:
        del engine.engine_core_step
    assert not engine.has_unfinished_requests()
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_shutdown_ends_open_streams_with_engine_dead_error(llm):
    a = AsyncLLM(llm.llm_engine, log_stats=False)

    async def run():
        stream = await a.add_request("f", "Tell me a story", _greedy(500))
        await stream.__anext__()
        threading.Thread(target=a.shutdown).start()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        await asyncio.sleep(0)
        with pytest.raises(EngineDeadError):
            await a.add_request("g", "hi", _greedy(2))

    asyncio.run(run())
    a._thread.join()
    assert not llm.llm_engine.has_unfinished_requests()


def test_outputs_are_processed_on_a_thread_of_their_own(async_llm):
    """The engine thread only steps; detokenizing and RequestOutputs are the output thread's
    (EngineCoreOutputs cross between them), and stats() counts the two apart."""
    engine, seen = async_llm.engine, {"core": set(), "out": set()}
    real_core, real_process = engine.engine_core_step, engine.output_processor.process

    def core():
        seen["core"].add(threading.get_ident())
        return real_core()

    def process(*a, **kw):
        seen["out"].add(threading.get_ident())
        return real_process(*a, **kw)

    engine.engine_core_step, engine.output_processor.process = core, process
    before = async_llm.stats()
    try:
        async def run():
            return [o async for o in async_llm.generate("Hello there", _greedy(6), request_id="t")]
        outs = asyncio.run(run())
    finally:
        del engine.engine_core_step, engine.output_processor.process
    after = async_llm.stats()
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 6
    assert len(seen["core"]) == 1 and len(seen["out"]) == 1 and seen["core"] != seen["out"]
    assert after.num_generation_tokens - before.num_generation_tokens == 6
    assert after.output_cpu_seconds > before.output_cpu_seconds
    assert after.host_cpu_seconds > before.host_cpu_seconds


def test_stop_strings_found_a_step_behind_give_the_offline_outputs(llm, async_llm):
    """A stop string is found on the output thread while the engine thread may already run
    the next steps: no token past it is emitted, the texts, tokens and reasons equal the
    offline engine's, and the engine frees the sequences' blocks."""
    prompts = [f"Count with me: {i}, {i + 1}," for i in range(4)]
    def sp(kind):  # two seeded samples each, stopped at the first comma after 2 tokens
        return SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=40, stop=[","], min_tokens=2,
                              output_kind=kind)
    refs = llm.generate(prompts, sp(RequestOutputKind.FINAL_ONLY), use_tqdm=False)
    assert all(c.stop_reason == "," for r in refs for c in r.outputs)  # the stop is hit

    async def one(i):
        last = None
        async for out in async_llm.generate(prompts[i], sp(RequestOutputKind.CUMULATIVE), request_id=f"s{i}"):
            last = out
        return last

    async def run():
        outs = await asyncio.gather(*(one(i) for i in range(4)))
        for _ in range(200):  # the engine thread applies the stops before its next step
            s = async_llm.stats()
            if s.num_running == 0 and s.num_free_blocks == s.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        return outs, async_llm.stats()

    engine, behind = async_llm.engine, []
    real_stop = engine.stop_requests

    def stop_requests(stops):  # how far the engine ran past each stop string
        behind.extend(engine.scheduler.requests[rid].num_output_tokens - keep
                      for _, rid, _, keep in stops if rid in engine.scheduler.requests)
        return real_stop(stops)

    engine.stop_requests = stop_requests
    try:
        outs, s = asyncio.run(run())
    finally:
        del engine.stop_requests
    assert len(behind) == 8 and max(behind) > 0  # some ran on past their stop string
    for got, ref in zip(outs, refs):
        assert got.finished
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in got.outputs] == \
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in ref.outputs]
    assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks


def test_a_failing_output_thread_ends_every_stream(llm):
    engine = llm.llm_engine
    real, calls = engine.output_processor.process, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("tokenizer broke")
        return real(*a, **kw)

    engine.output_processor.process = failing
    a = AsyncLLM(engine, log_stats=False)
    try:
        async def run():
            stream = await a.add_request("o1", "Tell me a story", _greedy(50))
            with pytest.raises(EngineDeadError, match="tokenizer broke"):
                async for _ in stream:
                    pass
        asyncio.run(run())
        a._thread.join(10)
        assert not a._thread.is_alive() and not a._out.alive
    finally:
        del engine.output_processor.process
    assert not engine.has_unfinished_requests() and not engine.output_processor.groups
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def _lagging_outputs(engine, seconds: float):
    """Make the output thread lag the engine thread by `seconds` per step (restore with
    `del engine.output_processor.process`)."""
    real = engine.output_processor.process

    def slow(*a, **kw):
        time.sleep(seconds)
        return real(*a, **kw)
    engine.output_processor.process = slow


def test_an_id_is_free_once_a_stop_string_final_output_arrives(llm, async_llm):
    """The final output of a request a stop string ended reaches its caller only after the
    engine finished it: the id can be used again at once, and the new request gets only its
    own tokens (never the old one's steps that were still queued)."""
    prompt = "Count with me: 1, 2, 3,"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    ref2 = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = ref.text[:max(1, len(ref.text) // 3)]
    _lagging_outputs(async_llm.engine, 0.01)
    try:
        async def run():
            for _ in range(3):
                sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
                outs = [o async for o in await async_llm.add_request("a", prompt, sp)]
                assert outs[-1].outputs[0].finish_reason == "stop"
                s = async_llm.stats()
                assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks
                again = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                       output_kind=RequestOutputKind.FINAL_ONLY)
                outs = [o async for o in await async_llm.add_request("a", "Hello", again)]
                assert outs[-1].outputs[0].token_ids == ref2.token_ids
        asyncio.run(run())
    finally:
        del async_llm.engine.output_processor.process


def test_shutdown_with_a_stop_string_in_flight_leaves_the_engine_clean(llm):
    """A stop string the output thread finds while the engine shuts down is still applied:
    no request keeps its blocks."""
    engine = llm.llm_engine
    prompt = "Count with me: 1, 2, 3,"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    _lagging_outputs(engine, 0.05)
    a = AsyncLLM(engine, log_stats=False)
    try:
        async def run():
            sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, stop=[ref.text[:1]])
            stream = await a.add_request("z", prompt, sp)
            await asyncio.sleep(0.02)  # the engine ran ahead; the output thread lags
            a.shutdown()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        asyncio.run(run())
    finally:
        del engine.output_processor.process
    assert not engine.has_unfinished_requests() and not engine.output_processor.groups
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks
