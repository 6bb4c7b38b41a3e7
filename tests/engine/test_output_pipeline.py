"""LLM.generate's output thread (jaxkv/engine/output_pipeline.py): steps on the calling
thread, output processing beside them, stop strings applied a step or more behind."""

from __future__ import annotations

import threading
import time

import pytest

from jaxkv.sampling.params import SamplingParams


def _sync_generate(engine, prompts, sp):
    """The reference: LLMEngine.step in turn (outputs processed right after each step)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"ref{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[f"ref{i}"] for i in range(len(prompts))]


def _clean(engine) -> bool:
    s = engine.stats()
    return not engine.has_unfinished_requests() and s.num_free_blocks == s.num_total_blocks


def test_generate_processes_outputs_beside_the_steps_with_the_same_outputs(llm):
    """Stop strings found a few steps late (the output thread slowed) give the outputs of
    the synchronous loop, and the engine holds nothing once generate returns."""
    engine = llm.llm_engine
    prompts = [f"Count with me: {i}, {i + 1}," for i in range(4)]
    sp = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=40, stop=[","], min_tokens=2)
    ref = _sync_generate(engine, prompts, sp)
    real, threads = engine.output_processor.process, set()

    def slow(*a, **kw):
        threads.add(threading.get_ident())
        time.sleep(0.01)
        return real(*a, **kw)
    engine.output_processor.process = slow
    try:
        got = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        del engine.output_processor.process
    assert threading.get_ident() not in threads and len(threads) == 1
    assert all(c.stop_reason == "," for r in ref for c in r.outputs)
    for g, r in zip(got, ref):
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in r.outputs]
    assert _clean(engine)


def test_an_output_thread_error_is_raised_by_generate_and_the_engine_stays_usable(llm):
    engine = llm.llm_engine
    real, calls = engine.output_processor.process, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("tokenizer broke")
        return real(*a, **kw)
    engine.output_processor.process = failing
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        with pytest.raises(RuntimeError, match="tokenizer broke"):
            llm.generate(["Tell me a story", "Hello"], sp, use_tqdm=False)
    finally:
        del engine.output_processor.process
    assert _clean(engine) and not engine.output_processor.groups
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_generate_hands_over_outputs_an_earlier_step_held_back(llm):
    """Outputs LLMEngine.step kept after its output processing raised do not keep generate
    looping: it delivers them and returns."""
    engine = llm.llm_engine
    engine.add_request("held", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    real, calls = engine.output_processor.process_token, []

    def once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("tokenizer broke once")
        return real(*a, **kw)
    engine.output_processor.process_token = once
    try:
        with pytest.raises(RuntimeError, match="once"):
            while True:
                engine.step()
    finally:
        del engine.output_processor.process_token
    box = {}
    t = threading.Thread(target=lambda: box.update(out=llm.generate(
        "Hi", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)),
        daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive() and len(box["out"][0].outputs[0].token_ids) == 2
    assert not engine.take_pending_outputs() and _clean(engine)
