"""Async scheduling (jaxkv/runner/lookahead.py): the next decode step runs ahead of the
scheduler, and what it computed is used only where the scheduler then asks exactly that.
The engine's outputs must be those of synchronous scheduling, token for token, through
arrivals, aborts, stops, seeded sampling, logprobs, penalties and prefix hits, and no block
may leak. At most 4 sequences decode at once here, so their steps' matmuls and LM head take
the `cpu` backend's row-invariant kernels. A prompt that arrives while decodes run ahead is
computed in a step of its own instead of next to them, a different batch for XLA's dots (more
than 8 rows), so its K/V (and the logprobs after it) may differ in the last bits: tokens must
be equal, logprobs within 1e-4."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.core.scheduler_output import ScheduledRequest
from jaxkv.runner import lookahead as la
from jaxkv.runner.buckets import pick_bucket

PROMPTS = ["The capital of France is", "Write a haiku about rain.", "List three prime numbers:",
           "Once upon a time, a robot", "Explain photosynthesis in one sentence."]


def _script():
    """(step, action) pairs: requests added at steps 0, 6 and 12, one aborted at step 9."""
    return {
        0: [("add", "a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20)),
            ("add", "b", PROMPTS[1], SamplingParams(temperature=0.9, seed=7, max_tokens=24)),
            ("add", "c", PROMPTS[2], SamplingParams(temperature=0, logprobs=2, min_tokens=3,
                                                    max_tokens=16))],
        6: [("add", "d", PROMPTS[3], SamplingParams(temperature=0, repetition_penalty=1.3,
                                                    max_tokens=10))],
        9: [("abort", "a")],
        12: [("add", "e", PROMPTS[4], SamplingParams(temperature=0.7, seed=3, top_k=20,
                                                     stop=["."], max_tokens=30)),
             ("add", "f", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))],
    }


def _run(engine, async_on: bool):
    runner = engine.runner
    saved = runner.async_scheduling
    runner.async_scheduling = async_on
    try:
        script, final, step = _script(), {}, 0
        while step in script or step < 13 or engine.has_unfinished_requests():
            for action in script.get(step, []):
                if action[0] == "add":
                    engine.add_request(action[1], action[2], action[3])
                else:
                    for o in engine.abort_request(action[1]):
                        final[o.request_id] = o
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
            step += 1
            assert step < 400
        return final
    finally:
        runner.async_scheduling = saved


def _summary(outs):
    return {rid: [(c.token_ids, c.finish_reason, c.text) for c in o.outputs]
            for rid, o in sorted(outs.items())}


def test_async_outputs_equal_synchronous_ones(llm):
    engine = llm.llm_engine
    before = engine.stats()
    got = _run(engine, True)
    after = engine.stats()
    ref = _run(engine, False)
    assert _summary(got) == _summary(ref)
    assert set(got) == {"a", "b", "c", "d", "e", "f"}
    lp, lp_ref = got["c"].outputs[0].logprobs, ref["c"].outputs[0].logprobs
    assert len(lp) == len(lp_ref) == len(got["c"].outputs[0].token_ids)
    for x, y in zip(lp, lp_ref):
        assert x.keys() == y.keys()
        np.testing.assert_allclose([v.logprob for v in x.values()], [v.logprob for v in y.values()],
                                   rtol=0, atol=1e-4)
    used = after.num_async_steps_used - before.num_async_steps_used
    assert used >= 10  # the steady decodes ran ahead
    assert after.num_async_steps >= used + after.num_async_steps_discarded - before.num_async_steps_discarded
    s = engine.stats()
    assert s.num_running == s.num_waiting == 0
    assert s.num_free_blocks == s.num_total_blocks  # nothing leaked (cached blocks are free)


def test_async_prefix_hits_equal_synchronous_ones(llm):
    """The same requests again hit the prefix cache filled by runs that stopped early (EOS,
    stop strings, aborts): the rows written ahead into freed blocks never reach a hash."""
    engine = llm.llm_engine
    first = _run(engine, True)
    again = _run(engine, True)
    ref = _run(engine, False)
    assert _summary(first) == _summary(again) == _summary(ref)


def test_llm_generate_with_and_without_async_scheduling(llm):
    runner = llm.llm_engine.runner
    sp = [SamplingParams(temperature=0, max_tokens=n) for n in (5, 17, 33, 40)]
    saved = runner.async_scheduling
    try:
        runner.async_scheduling = False
        ref = llm.generate(PROMPTS[:4], sp, use_tqdm=False)
        runner.async_scheduling = True
        n0 = runner.num_ahead_used
        got = llm.generate(PROMPTS[:4], sp, use_tqdm=False)
        assert runner.num_ahead_used - n0 >= 20
    finally:
        runner.async_scheduling = saved
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [len(o.outputs[0].token_ids) for o in got] == [5, 17, 33, 40]


def test_penalty_rows_run_ahead_and_equal_synchronous_ones(llm):
    """Repetition, frequency and presence penalties read the token history, whose last token
    the step run ahead takes on the device: their steady decodes run ahead too, with the
    synchronous engine's tokens (greedy and seeded random, beside a plain row)."""
    runner = llm.llm_engine.runner
    sp = [SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=11, frequency_penalty=1.2, max_tokens=26, ignore_eos=True),
          SamplingParams(temperature=0, presence_penalty=1.5, logprobs=1, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)]
    saved = runner.async_scheduling
    try:
        runner.async_scheduling = False
        ref = llm.generate(PROMPTS[:4], sp, use_tqdm=False)
        runner.async_scheduling = True
        n0, steady = runner.num_ahead_used, runner.num_ahead_steady
        got = llm.generate(PROMPTS[:4], sp, use_tqdm=False)
        assert runner.num_ahead_used - n0 >= 20
        assert runner.num_ahead_steady - steady >= 15  # their arrays carried on (steady_batch.py)
    finally:
        runner.async_scheduling = saved
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    for o, r in zip(got[2].outputs[0].logprobs, ref[2].outputs[0].logprobs):
        assert o.keys() == r.keys()
        np.testing.assert_allclose([v.logprob for v in o.values()], [v.logprob for v in r.values()], atol=1e-4)
    plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)  # (the penalty changed the tokens: it was applied)
    assert got[0].outputs[0].token_ids != plain[0].outputs[0].token_ids


def test_switching_async_scheduling_off_mid_decode_stops_running_ahead(llm):
    """The run-time switch holds on the steady batch's fast path too: once off, the step run
    ahead is taken and none follows it."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    saved = runner.async_scheduling
    try:
        for i in range(2):
            engine.add_request(f"t{i}", PROMPTS[i], sp)
        steady = runner.num_ahead_steady
        for _ in range(10):
            engine.step()
        assert runner.num_ahead_steady > steady
        runner.async_scheduling = False
        engine.step()  # takes the step run ahead
        dispatched = runner.num_ahead_dispatched
        for _ in range(5):
            engine.step()
        assert runner.num_ahead_dispatched == dispatched and not runner.step_ahead_pending
    finally:
        runner.async_scheduling = saved
        engine.abort_request(["t0", "t1"])


# ---- the host-side rules ---------------------------------------------------------------
def _sched(**kw):
    base = dict(request_id="r", token_ids=[5], num_computed_tokens=20, block_ids=[3, 4],
                sample=True, sampling_params=SamplingParams(temperature=0, max_tokens=50),
                seed=1, sample_index=0, num_output_tokens=4)
    base.update(kw)
    return ScheduledRequest(**base)


def test_predict_the_next_decode():
    s = _sched()
    q = la.predict(s, 16, 1024)
    assert (q.num_computed_tokens, q.num_output_tokens, q.token_ids, q.block_ids) == (21, 5, [0], [3, 4])
    assert q.sampling_params is s.sampling_params
    q.token_ids = [9]
    nxt = dataclasses.replace(s, token_ids=[9], num_computed_tokens=21, num_output_tokens=5)
    assert la.same_step(nxt, q)
    assert not la.same_step(dataclasses.replace(nxt, token_ids=[8]), q)
    assert not la.same_step(dataclasses.replace(nxt, block_ids=[3, 7]), q)
    assert not la.same_step(dataclasses.replace(nxt, num_output_tokens=6), q)
    assert not la.same_step(dataclasses.replace(nxt, sampling_params=SamplingParams(temperature=0, max_tokens=50)), q)
    assert not la.same_step(dataclasses.replace(nxt, output_token_ids=[1]), q)


@pytest.mark.parametrize("change", [
    dict(sample=False), dict(spec_token_ids=[1, 2]),
    dict(sampling_params=SamplingParams(temperature=0, max_tokens=50, bad_words=["x"])),
    dict(prompt_logprob_targets=[4]), dict(grammar_bitmask=np.zeros(3, np.int32)),
    dict(num_computed_tokens=31),  # the next position (32) needs a block not yet held
    dict(num_output_tokens=49),    # its token now is its last (max_tokens 50)
])
def test_predict_refuses_what_the_host_decides(change):
    assert la.predict(_sched(**change), 16, 1024) is None


def test_predict_stops_at_max_model_len():
    assert la.predict(_sched(), 16, 22) is None
    assert la.predict(_sched(), 16, 23) is not None


def test_plan_leaves_out_sequences_ending_by_length_and_indexes_both_outputs():
    """Rows of the step run ahead: those going on, in order, each taking its token from its
    sampler output (0 or 1) and row; one sampling its last token (max_tokens 50 or
    max_model_len) anywhere in the batch is left out."""
    a, b = _sched(request_id="a"), _sched(request_id="b", num_output_tokens=49)
    c = _sched(request_id="c", num_computed_tokens=4, token_ids=[5, 6, 7])  # a prompt's end
    sources = {"a": (0, 3), "b": (0, 1), "c": (1, 2)}
    predicted, index = la.plan([a, b, c], sources, 16, 1024, rows=8)
    assert [q.request_id for q in predicted] == ["a", "c"] and index == [3, 8 + 2]
    assert (predicted[1].num_computed_tokens, predicted[1].num_output_tokens) == (7, 5)
    assert [q.request_id for q in la.plan([a, c], sources, 16, 22, rows=8)[0]] == ["c"]
    assert la.plan([b], sources, 16, 1024, rows=8) is None  # nothing goes on
    chunk = _sched(request_id="c", num_computed_tokens=4, token_ids=[5, 6], sample=False)
    predicted, index = la.plan([chunk, a], {"a": (0, 3)}, 16, 1024, rows=8)  # a prompt chunk
    assert [q.request_id for q in predicted] == ["a"] and index == [3]  # runs beside it
    assert la.plan([chunk], {}, 16, 1024, rows=8) is None  # nothing to run ahead
    assert la.plan([a, c], {"a": (0, 3)}, 16, 1024, rows=8) is None  # c's tokens: not given
    bad = _sched(request_id="c", sampling_params=SamplingParams(temperature=0, max_tokens=50,
                                                                bad_words=["x"]))
    assert la.plan([a, bad], sources, 16, 1024, rows=8) is None  # the host decides c's next


def test_a_penalty_is_predicted_and_matched_by_its_own_history_list():
    """The scheduler hands a penalty row its request's own history lists; the prediction
    keeps them, and only the same lists (grown by the sampled token) match it."""
    sp = SamplingParams(temperature=0, max_tokens=50, frequency_penalty=0.5)
    prompt, output = [7, 8, 9], [1, 2, 3, 4]
    s = _sched(sampling_params=sp, prompt_token_ids=prompt, output_token_ids=output)
    q = la.predict(s, 16, 1024)
    assert q is not None and q.output_token_ids is output and q.prompt_token_ids is prompt
    q.token_ids = [9]
    output.append(9)  # update_from_output appends the sampled token to the request's list
    nxt = dataclasses.replace(s, token_ids=[9], num_computed_tokens=21, num_output_tokens=5)
    assert la.same_step(nxt, q)
    assert not la.same_step(dataclasses.replace(nxt, output_token_ids=list(output)), q)
    assert not la.same_step(dataclasses.replace(nxt, prompt_token_ids=list(prompt)), q)


def test_min_tokens_ban_follows_the_output_count():
    sp = SamplingParams(temperature=0, max_tokens=50, min_tokens=6)
    q = la.predict(_sched(sampling_params=sp, min_tokens_banned_ids=[2]), 16, 1024)
    assert q.min_tokens_banned_ids == [2]  # 5 outputs after this token: still banned
    q = la.predict(_sched(sampling_params=sp, num_output_tokens=5, min_tokens_banned_ids=[2]), 16, 1024)
    assert q.min_tokens_banned_ids == []


def test_async_scheduling_is_refused_where_unsupported():
    from jaxkv.engine_args import EngineArgs
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(async_scheduling="yes")


def test_a_request_arriving_while_a_step_runs_ahead_joins_the_next_step(llm):
    """As vLLM's async scheduler admits an arrival into the step it schedules next: the
    decodes computed ahead are taken, the new prompt runs as a program beside them, and the
    step after (all three decoding) is run ahead from both programs' tokens, its arrays those
    of the batch run ahead with the new row joined."""
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    calls = []
    forward = runner.forward
    runner.forward = lambda si: calls.append(si.num_tokens) or forward(si)
    saved = runner.async_scheduling
    runner.async_scheduling = True
    try:
        for rid in ("x1", "x2"):
            engine.add_request(rid, PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        for _ in range(40):
            engine.step()
            if runner.step_ahead_pending:
                break
        assert runner.step_ahead_pending
        engine.add_request("x3", PROMPTS[2], SamplingParams(temperature=0, max_tokens=5))
        calls.clear()
        used = runner.num_ahead_used
        engine.step()  # x1, x2 take the step run ahead; x3's prompt runs; all three run ahead
        assert engine.scheduler.requests["x3"].status.name == "RUNNING"
        assert runner.num_ahead_used == used + 1 and runner.step_ahead_pending
        n = len(engine.tokenize_prompt(PROMPTS[2])[1])
        assert calls == [pick_bucket(runner.compiled_token_buckets, n),
                         pick_bucket(runner.compiled_token_buckets, 3)]
        # (built by editing the batch run ahead, its new row joined: SteadyBatch.join)
        assert runner._ahead.predicted is None and runner._ahead.batch.ids == ("x1", "x2", "x3")
        engine.step()  # the three decodes taken from the step run ahead: no forward of their own
        assert runner.num_ahead_used == used + 2 and len(calls) == 3
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.forward = forward
        runner.async_scheduling = saved


def test_a_steady_batch_of_any_size_decodes_ahead_every_step(tmp_path):
    """Prompts of different lengths cross block boundaries at different steps; the scheduler
    allocates each sampling sequence a lookahead slot (num_lookahead_tokens 1 with async
    scheduling), so every steady decode step at batch 1, 32 and 128 is dispatched ahead and
    used (without the slot: 0.94, 0.12 and 0 on this workload). Tokens equal a synchronous
    engine's, and every block is free at the end."""
    from benchmarks.e2e_decode import TINY_CONFIG, model_folder
    from jaxkv import LLM
    folder = model_folder(TINY_CONFIG, str(tmp_path))
    for b in (1, 32, 128):
        rng = np.random.default_rng(b)
        ps = [{"prompt_token_ids": rng.integers(3, 500, int(k)).tolist()} for k in rng.integers(4, 24, b)]
        kw = dict(model=folder, load_format="dummy", max_model_len=96, max_num_seqs=b,
                  max_num_batched_tokens=max(b, 256), token_buckets=tuple(sorted({b, 256})),
                  enable_prefix_caching=False, kv_cache_memory_bytes="32MiB")
        llm = LLM(**kw)
        assert llm.llm_engine.scheduler.config.num_lookahead_tokens == 1
        engine, sp = llm.llm_engine, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i, x in enumerate(ps):
            engine.add_request(str(i), x, sp)
        outs, started = {}, set()
        while len(started) < b:
            started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
        before, steady = engine.stats(), engine.runner.num_ahead_steady
        for _ in range(16):
            engine.step()
        after = engine.stats()
        assert after.num_async_steps_used - before.num_async_steps_used == 16, b
        # ... all but the first of them by the steady batch's fast path (steady_batch.py)
        assert engine.runner.num_ahead_steady - steady >= 15, b
        assert after.num_steps - before.num_steps == 16  # and the host's CPU time they took
        assert 0 < after.host_cpu_seconds - before.host_cpu_seconds < 16 * 1.0
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        kv = engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_total_blocks
        sync = LLM(**kw, async_scheduling=False).generate(ps, sp, use_tqdm=False)
        assert [list(outs[str(i)]) for i in range(b)] == [list(o.outputs[0].token_ids) for o in sync], b


def test_decodes_run_ahead_beside_a_chunked_prompt(tmp_path):
    """A prompt longer than the step's token budget is computed in chunks that sample
    nothing; the decodes beside it are still run ahead each step (lookahead.plan leaves the
    chunk out: its next chunk runs as a program beside the step run ahead), and every token
    equals a synchronous engine's, with no block leaked."""
    from benchmarks.e2e_decode import TINY_CONFIG, model_folder
    from jaxkv import LLM
    rng = np.random.default_rng(5)
    short = [{"prompt_token_ids": rng.integers(3, 500, 6).tolist()} for _ in range(3)]
    long = {"prompt_token_ids": rng.integers(3, 500, 150).tolist()}
    kw = dict(model=model_folder(TINY_CONFIG, str(tmp_path)), load_format="dummy", max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 32),
              enable_prefix_caching=False, kv_cache_memory_bytes="16MiB")
    llm = LLM(**kw)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, x in enumerate(short):
        engine.add_request(str(i), x, sp)
    outs = {}
    while not runner.step_ahead_pending:
        engine.step()
    engine.add_request("long", long, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    before = engine.stats()
    for _ in range(6):  # the long prompt's chunks (29 tokens beside 3 decodes), then its decode
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    after = engine.stats()
    assert engine.scheduler.requests["long"].num_output_tokens >= 1
    assert after.num_async_steps_used - before.num_async_steps_used == 6  # (before: 1 of 6)
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks
    sync = LLM(**kw, async_scheduling=False).generate(
        short + [long], [sp] * 3 + [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)], use_tqdm=False)
    assert [list(outs[k]) for k in ("0", "1", "2", "long")] == [list(o.outputs[0].token_ids) for o in sync]


@pytest.mark.parametrize("penalty", [None, 1.3])
def test_finishes_and_arrivals_keep_the_steady_batch(tmp_path, penalty, monkeypatch):
    """Requests finishing at different steps and others admitted in their place, as in an
    offline workload: the steps run ahead are taken by the steady batch's fast path with rows
    dropped and joined (SteadyBatch.match_rows and join: 81 of 82 steps on this workload;
    54 before), with a synchronous engine's tokens and no block leaked; only the first step
    run ahead is planned by the general path (lookahead.plan). With a repetition penalty the
    separate sampler samples every row: rows finishing are dropped from its batch
    (RowSampler.carry) and new ones merged in (RowSampler.merge; before, the 27 steps after
    an arrival were the general path's)."""
    from benchmarks.e2e_decode import TINY_CONFIG, model_folder
    from jaxkv import LLM
    from jaxkv.runner import lookahead as la
    planned, plan = [], la.plan
    monkeypatch.setattr(la, "plan", lambda *a, **k: planned.append(1) or plan(*a, **k))
    rng = np.random.default_rng(9)
    ps = [{"prompt_token_ids": rng.integers(3, 500, int(k)).tolist()} for k in rng.integers(4, 20, 40)]
    sps = [SamplingParams(temperature=float(rng.choice([0, 0.8])), seed=int(i), max_tokens=int(k),
                          ignore_eos=True, repetition_penalty=penalty or 1.0)
           for i, k in enumerate(rng.integers(4, 24, 40))]
    kw = dict(model=model_folder(TINY_CONFIG, str(tmp_path)), load_format="dummy", max_model_len=64,
              max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(8, 64),
              enable_prefix_caching=False, kv_cache_memory_bytes="16MiB")
    llm = LLM(**kw)
    outs = llm.generate(ps, sps, use_tqdm=False)
    s = llm.llm_engine.stats()
    assert s.num_async_steps_used / s.num_steps >= 0.9
    assert s.num_async_steps_steady / s.num_steps >= 0.8, (s.num_async_steps_steady, s.num_steps)
    assert len(planned) <= 2, len(planned)
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks
    sync = LLM(**kw, async_scheduling=False).generate(ps, sps, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in sync]
