"""Compilation is bounded: after warmup (and the background compile of the other token buckets)
a long mixed workload compiles nothing new, no step waits for a compile, and the outputs do not
depend on which bucket a step was padded to.

The background-compile tests use a tiny random model (2 layers, load_format="dummy"), whose
programs compile in a fraction of a second."""

import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.runner import compiler
from jaxkv.runner.model_runner import ModelRunner
from tests.helpers import write_tiny_model

TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# Default token buckets for a budget of 32 (1, 2, 4, 8, 16, 32); a custom split: 8 and 32 are
# compiled at warmup, 1, 2, 4 and 16 in the background.
TINY_ENGINE = dict(load_format="dummy", max_model_len=128, max_num_batched_tokens=32,
                   max_num_seqs=8, kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False,
                   warmup_token_buckets=(8, 32))
ALL, WARM = (1, 2, 4, 8, 16, 32), (8, 32)
# Prompt lengths of each generate call. With every bucket compiled the prefill steps take 1, 2,
# 3, 6, 12, 30, 9 and 10 tokens (buckets 1, 2, 4, 8, 16, 32, 16, 16) and the decode steps 1, 3
# and 5 (buckets 1, 4, 8): every bucket is used.
CALLS = [[1], [2], [3], [6], [12], [30], [3, 3, 3], [2, 2, 2, 2, 2]]


def test_no_new_compilation_after_warmup(llm):
    eng = llm.llm_engine
    before = eng.stats().num_compilations
    assert before > 0
    seen = _spy_buckets(eng.runner)
    rng = np.random.default_rng(3)
    for i in range(24):  # prompts from 3 to 300 tokens; greedy, random, top-k/top-p rows mixed
        n = int(rng.integers(3, 300))
        ids = rng.integers(100, 40000, n).tolist()
        kind = i % 3
        sp = SamplingParams(temperature=0.0 if kind == 0 else 0.9, top_p=0.8 if kind == 2 else 1.0,
                            top_k=20 if kind == 2 else 0, seed=i, ignore_eos=True,
                            max_tokens=int(rng.integers(1, 40)))
        eng.add_request(f"mix-{i}", {"prompt_token_ids": ids}, sp)
    steps = 0
    try:
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
    finally:
        del eng.runner.forward  # the class's method again
    assert steps >= 50
    assert seen == set(eng.config.runner.token_buckets)  # every bucket was used
    assert eng.stats().num_compilations == before


def _spy_buckets(runner) -> set:
    """Record the token bucket of every step the runner runs, until `del runner.forward`."""
    seen, forward = set(), runner.forward
    runner.forward = lambda step: seen.add(step.num_tokens) or forward(step)
    return seen


def _params(i):
    """Greedy, seeded random and seeded top-k rows in turn: every sampler mode is used."""
    return [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=i, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=5, seed=i, max_tokens=3, ignore_eos=True)][i % 3]


def _workload(llm):
    """Run CALLS; returns (token ids of every output, buckets used, programs compiled)."""
    runner = llm.llm_engine.runner
    n0 = llm.stats().num_compilations
    seen = _spy_buckets(runner)
    outs = []
    try:
        for c, lengths in enumerate(CALLS):
            prompts = [{"prompt_token_ids": list(range(10 + c, 10 + c + n))} for n in lengths]
            got = llm.generate(prompts, [_params(c + j) for j in range(len(lengths))], use_tqdm=False)
            outs += [o.outputs[0].token_ids for o in got]
    finally:
        del runner.forward
    return outs, seen, llm.stats().num_compilations - n0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A config.json and tokenizer files: a 2-layer Llama for load_format="dummy"."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), TINY_CONFIG)


@pytest.fixture(scope="module")
def held_back(tiny_model):
    """A tiny engine whose background compiler is not started by the build (the test starts
    it), and the workload run on it before any background bucket exists."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "start_background_compile", lambda self: None)
        llm = LLM(model=tiny_model, **TINY_ENGINE)
    stats = llm.stats()
    yield llm, stats, _workload(llm)
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def compiled(held_back):
    """The same engine once the background compiler has finished, and the workload again."""
    llm = held_back[0]
    compiler = ModelRunner.start_background_compile(llm.llm_engine.runner)
    assert compiler is not None and compiler.wait(120), "background compile did not finish"
    return compiler, llm.stats(), _workload(llm)


def test_before_the_background_buckets_land_steps_pad_to_compiled_ones(held_back):
    llm, stats, (outs, seen, compiled) = held_back
    assert stats.token_buckets == ALL and stats.compiled_token_buckets == WARM
    if llm.llm_engine.runner.background is None:  # not started yet: nothing to wait for
        assert llm.llm_engine.wait_for_background_compile(0) is False  # not all compiled
    assert seen == set(WARM)  # 1-token decodes padded to 8, a 12-token prefill to 32
    assert compiled == 0      # no step compiled anything


def test_after_the_background_compile_every_bucket_is_used_and_nothing_compiles(compiled):
    compiler, stats, (outs, seen, n) = compiled
    assert compiler.error is None and compiler.seconds > 0
    assert compiler.compiles.programs > 0
    assert stats.compiled_token_buckets == ALL and stats.num_compiled_token_buckets == 6
    assert seen == set(ALL)
    assert n == 0


def test_outputs_do_not_depend_on_the_bucket(held_back, compiled):
    before, after = held_back[2][0], compiled[2][0]
    assert len(before) == sum(map(len, CALLS)) and all(len(t) == 3 for t in before)
    assert after == before


def test_shutdown_and_deletion_stop_the_background_compiler(tiny_model):
    llm = LLM(model=tiny_model, **TINY_ENGINE)
    compiler = llm.llm_engine.runner.background
    assert compiler is not None and compiler._thread.daemon
    llm.llm_engine.shutdown()  # returns once the program in flight is done
    assert compiler.done and compiler.error is None and compiler.seconds is None
    compiled = llm.stats().compiled_token_buckets
    assert set(WARM) <= set(compiled) < set(ALL)
    # The engine goes on with what is compiled.
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, _params(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    llm = LLM(model=tiny_model, **TINY_ENGINE)
    compiler = llm.llm_engine.runner.background
    del llm, out
    gc.collect()
    assert compiler.wait(60) and compiler.seconds is None  # stopped, not finished


def test_exit_while_compiling_in_the_background_is_clean(tiny_model):
    """An interpreter that exits while a bucket compiles would abort in XLA; the exit waits
    for the program in flight instead."""
    code = ("from jaxkv import LLM\n"
            f"llm = LLM(model={tiny_model!r}, **{TINY_ENGINE!r})\n"
            "assert not llm.llm_engine.runner.background.done\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "background compile stopped" in r.stderr


def test_wait_reports_all_buckets_compiled_and_eager_lists_every_bucket(tiny_model, held_back,
                                                                        compiled):
    assert compiled[0].done and held_back[0].llm_engine.wait_for_background_compile(0) is True
    eager = LLM(model=tiny_model, enforce_eager=True, **TINY_ENGINE)
    try:
        assert eager.stats().compiled_token_buckets == ALL  # usable, nothing ahead of time
        assert eager.llm_engine.wait_for_background_compile(0) is True
    finally:
        eager.llm_engine.shutdown()


def test_warmup_on_several_threads_compiles_what_one_thread_does(tiny_model):
    """compile_buckets' waves on 3 threads: the same step and sampler programs, counted, as
    on one thread, compiled on the workers, and nothing left for the steps to compile."""
    made = {}
    for workers in (1, 3):
        threads = set()
        step = compiler._compile_step
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("jaxkv.runner.model_runner.compile_workers", lambda: workers)
            mp.setattr(ModelRunner, "start_background_compile", lambda self: None)
            mp.setattr(compiler, "_compile_step",
                       lambda *a: threads.add(threading.current_thread().name) or step(*a))
            llm = LLM(model=tiny_model, **TINY_ENGINE)
        try:
            p = llm.llm_engine.runner.programs
            made[workers] = (sorted(p.step), sorted(p.sampler_rows), llm.stats().num_compilations,
                             _workload(llm))
        finally:
            llm.llm_engine.shutdown()
        names = {n.split("_")[0] for n in threads}
        assert names == ({"MainThread"} if workers == 1 else {"jaxkv-compile"})
    one, three = made[1], made[3]
    assert one[0] == [(8, False), (32, False)] and one[1] == [8]
    assert three[:3] == one[:3] and one[2] >= 2 + 6
    assert three[3][2] == 0 and three[3][0] == one[3][0]  # nothing compiled by a step; same tokens


def test_a_compile_error_on_a_worker_is_raised_after_its_wave():
    done = []

    def bad():
        raise RuntimeError("no such program")

    with pytest.raises(RuntimeError, match="no such program"):
        compiler._run([lambda: done.append(1), bad, lambda: done.append(3)], 2, lambda: False)
    assert sorted(done) == [1, 3]  # the others ran to the end
    assert compiler._run([bad, bad], 2, lambda: True) is False  # stopped: none started


def test_compile_threads_from_the_environment(monkeypatch, tiny_model, tmp_path):
    monkeypatch.setenv("JAXKV_COMPILE_THREADS", "3")
    assert compiler.compile_workers() == 3
    monkeypatch.delenv("JAXKV_COMPILE_THREADS")
    assert compiler.compile_workers() >= 1
    monkeypatch.setattr(compiler.os, "sched_getaffinity", lambda pid: set(range(64)))
    quota = tmp_path / "cpu.max"
    for text, want in (("max 100000\n", 16), ("250000 100000\n", 3), ("50000 100000\n", 1),
                       ("garbage\n", 16)):
        quota.write_text(text)  # cgroup v2's CPU quota caps 64 CPUs; 16 at most in any case
        assert compiler.compile_workers(str(quota)) == want, text
    assert compiler.compile_workers(str(tmp_path / "none")) == 16
    for bad in ("0", "two", "-1", "3.0", "\u00b2"):
        monkeypatch.setenv("JAXKV_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match=f"JAXKV_COMPILE_THREADS must be a positive integer, got '{bad}'"):
            compiler.compile_workers()
    with pytest.raises(ValueError, match="JAXKV_COMPILE_THREADS"):  # the engine's build, at once
        LLM(model=tiny_model, **TINY_ENGINE)


def test_the_background_compiler_on_a_many_core_machine_uses_a_quarter_of_its_threads(tiny_model):
    """8 CPUs: warmup on 8 threads, the background compiler's waves on 2 at nice 19 (the
    sampler programs of row counts 1, 2 and 4, which only the background buckets need)."""
    made = []
    sampler = compiler._compile_sampler

    def spy(runner, params, tp, rows_out, mode, masked):
        me = threading.current_thread()
        made.append((rows_out.shape[0], me.name.split("_")[0],
                     os.getpriority(os.PRIO_PROCESS, me.native_id)))
        return sampler(runner, params, tp, rows_out, mode, masked)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jaxkv.runner.model_runner.compile_workers", lambda: 8)
        mp.setattr(compiler, "_compile_sampler", spy)
        llm = LLM(model=tiny_model, **TINY_ENGINE)
        try:
            bg = llm.llm_engine.runner.background
            assert bg.workers == 2 and bg.wait(120) and bg.error is None
            assert llm.stats().compiled_token_buckets == ALL
            outs, seen, n = _workload(llm)
        finally:
            llm.llm_engine.shutdown()
    assert seen == set(ALL) and n == 0
    late = [(name, nice) for rs, name, nice in made if rs in (1, 2, 4)]
    assert len(late) == 3 * 2 * 3 and set(late) == {("jaxkv-compile", 19)}
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # (the test's own)
    assert {(name, nice) for rs, name, nice in made if rs == 8} == {("jaxkv-compile", base)}
