"""The engine on a GPU against its own device step: the measurements of issue 38, one process.

  python -m benchmarks.gpu_engine                  # Llama-3-8B shapes, random bf16 weights
  python -m benchmarks.gpu_engine --cpu-dry-run    # a tiny model on the CPU (a test runs this)
  python -m benchmarks.gpu_engine --config benchmarks/configs/llama3-8b-narrow --stages decode \
      --attention-backend cpu --prompt-len 16 --kv-cache-memory-bytes 512MiB   # host work, CPU

Rows go to <dir>/5_gpu_engine.jsonl as measured (benchmarks/result_rows.py: $OUT, else
benchmarks/results/gpu/), one per measurement, "stage" naming it, in this order:
  decode   one engine with a token bucket per batch size B; per B, B requests of 128-token
           prompts, once all are past their prefill (a steady batch): engine ms/step and tok/s
           over N decode steps (engine_core_step with output processing on a thread
           beside it, as LLM.generate runs them; async scheduling on; with
           --num-scheduler-steps k, about N / k engine steps of k decode steps each), the share
           of engine steps that used a step dispatched ahead (stats().num_async_steps_used) and
           of those the steady batch's fast path took (num_async_steps_steady), the
           engine thread's CPU time per decode step (stats().host_cpu_seconds) and output
           processing's apart (output_cpu_seconds: the output thread), the device-only step
           (runner.forward, the step program without the LM head and the sampler, as the
           2026-12-04 probe timed it: one prebuilt decode StepInput, `reps` calls back to
           back, one block at the end), and the host's dispatch per call. Each B twice: the
           step run ahead dispatched on the engine thread ("launched": false), then from the
           launcher's thread (true, the default; jaxkv/runner/launcher.py). Each row also
           says whether the projections were fused (`--projections fused|unfused` forces it:
           an A/B), whether its layers are scanned (`--scan-layers`: the decode stage's
           engine runs them as one loop over stacked weights) and what the step program
           moves without computing (hlo_moves: a scan that copies each layer's slice of its
           weights out shows dynamic-slice moves there).
  trace    on that engine, a jax.profiler trace of 32 steady decode steps at batch 128 (the
           largest batch below it on a dry run): GPU busy time (the union of the kernels'
           intervals), idle time and share, kernels per step (None without GPU events),
           kernel ms per step by kind (gemm, attention, K/V write, other), the share of
           kernel time in command buffers and the top kernels (benchmarks/trace_kernels.py).
           The decode rows' dispatch_ms near device_step_ms would mean enqueueing a step
           waited for the device (a conditional outside the command buffer:
           jaxkv/runner/xla_options.py).
  warmup   the offline engine's start (default token buckets). The script turns the
           compilation cache off unless JAXKV_COMPILATION_CACHE says otherwise, but the
           engines before it compiled in the same process: an upper bound of cold it is not.
           Its row says on how many threads warmup compiled (one per CPU since 2026-12-06;
           JAXKV_COMPILE_THREADS=1 is the 2026-12-04 run's single thread).
  offline  that engine on FULL["offline_requests"] requests (prompts of 32-512 random
           tokens, outputs of 32-384; issue 38's workload has 1,000): output and total tok/s.
  serving  the same engine under AsyncLLM, requests arriving at a fixed rate: TTFT and ITL
           p50 / p99 (the engine's own timestamps, no HTTP: the GPU machine has no FastAPI).
  memory   (with offline or serving) that engine's compiled step programs' memory_analysis():
           arguments, outputs, aliased pool, temporaries and the peak, against weights + pool
           + 4 GiB (the 2026-12-04 engine's XLA warned of ~120 GiB); where the temporaries
           reach a tenth of the pool, the HLO's values of that size and its copies.
  smoke    paths not run on a GPU before, on the model's first 2 layers and small token
           buckets, against the plain engine's greedy tokens: int8 and fp8 KV pools, n-gram
           speculative decoding, prefix hits, and a structured-output request when llguidance
           is installed (the benchmark's word-level tokenizer is one it cannot read: that row
           reports the error).
  multistep  the decode rows of the two largest batches again on an engine with multi-step
           decode (num_scheduler_steps 4, jaxkv/runner/multi_step.py): "decode" rows whose
           num_scheduler_steps is 4, per decode step.
Weights are random (load_format="dummy"); the folder gets a word-level tokenizer
(benchmarks/e2e_decode.model_folder). Rows hold the device name; compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import shutil
import tempfile
import time

import numpy as np

from benchmarks import trace_kernels
from benchmarks.e2e_decode import TINY_CONFIG, model_folder
from benchmarks.result_rows import Rows
from jaxkv.engine.gc_heap import freeze_startup_heap, release_frozen_heap
from jaxkv.engine.output_pipeline import OutputPipeline

# The H200 run's sizes (gpu_check.sh gives the script 330 s; rows land as measured, so a
# cut keeps the earlier stages) and the CPU dry run's (token_buckets None: the defaults).
FULL = dict(batches=[1, 32, 128, 256], prompt_len=128, decode_tokens=32, reps=30,
            kv="24GiB", offline_requests=400, serving_requests=100, serving_rate=20.0,
            max_num_seqs=256, max_model_len=2048, trace_steps=32, token_buckets=None, k=1, multi_k=4,
            repetition_penalty=1.0, scan=False)
DRY = dict(batches=[1, 4], prompt_len=8, decode_tokens=4, reps=3, kv="32MiB",
           offline_requests=12, serving_requests=6, serving_rate=50.0, max_num_seqs=8,
           max_model_len=256, trace_steps=4, token_buckets=(4, 32), k=1, multi_k=4,
           repetition_penalty=1.0, scan=False)


def percentile(xs, q: float):
    return round(float(np.percentile(xs, q)), 4) if len(xs) else None


def prompts(rng, n: int, length: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": rng.integers(3, vocab, length).tolist()} for _ in range(n)]


def device_step(llm, batch: int, context: int, reps: int, vocab: int) -> tuple[float, float]:
    """(device-only decode step ms, host dispatch ms per call) at `batch` sequences of
    `context` tokens: one StepInput built once, `reps` forward calls, one block at the end."""
    import jax

    from jaxkv import SamplingParams
    from jaxkv.core.scheduler_output import ScheduledRequest, SchedulerOutput
    runner = llm.llm_engine.runner
    per, usable = -(-context // runner.block_size), runner.num_blocks - 1
    rng, sp = np.random.default_rng(0), SamplingParams(temperature=0)
    blocks = lambda s: [1 + (s * per + j) % usable for j in range(per)]  # noqa: E731 (contents unread)
    out = SchedulerOutput([ScheduledRequest(f"d{s}", [int(rng.integers(3, vocab))], context - 1,
                                            blocks(s), True, sp, s, 0, 0) for s in range(batch)])
    si = runner.build_inputs(out)
    jax.block_until_ready(runner.forward(si))
    t0 = time.perf_counter()
    for _ in range(reps):
        r = runner.forward(si)
    dispatch = time.perf_counter() - t0
    jax.block_until_ready(r)
    total = time.perf_counter() - t0
    return 1e3 * total / reps, 1e3 * dispatch / reps


def steady_decode(engine, ps, n: int, tag: str, max_tokens: int,
                  around=contextlib.nullcontext, repetition_penalty: float = 1.0) -> tuple:
    """Add `ps` (each may write `max_tokens`, more than the steps timed: none finishes while
    timed), step until every one has its first token (prefill done: a steady batch), time
    engine steps until every one has `n` more tokens (n decode steps: n engine steps, or
    fewer with multi-step decode; inside the context `around()`: a profiler trace), then
    abort them; returns (seconds, the share of engine steps that used a step dispatched
    ahead, the engine thread's CPU ms per decode step, engine steps, output processing's
    CPU ms per decode step, the share of engine steps the steady batch's fast path took). The timed steps run as LLM.generate runs them: output
    processing on a thread beside the engine's (jaxkv/engine/output_pipeline.py). Greedy,
    with `repetition_penalty` (1: off; else every row reads its token history)."""
    from jaxkv import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                        repetition_penalty=repetition_penalty)
    ids = [f"{tag}{i}" for i in range(len(ps))]
    for rid, x in zip(ids, ps):
        engine.add_request(rid, x, sp)
    started = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
    pipe = OutputPipeline(engine, lambda outputs: None)  # as LLM.generate runs the steps
    try:
        with around():
            before, t0 = engine.stats(), time.perf_counter()
            made, steps = 0, 0
            while made < n * len(ids):
                made += pipe.step()
                steps += 1
            dt = time.perf_counter() - t0
    finally:
        error = pipe.close()  # (the output thread's last steps, after the timed ones)
    if error is not None:
        raise error
    after = engine.stats()
    used = after.num_async_steps_used - before.num_async_steps_used
    steady = after.num_async_steps_steady - before.num_async_steps_steady
    host_ms = 1e3 * (after.host_cpu_seconds - before.host_cpu_seconds) / n
    output_ms = 1e3 * (after.output_cpu_seconds - before.output_cpu_seconds) / n
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return dt, used / steps, host_ms, steps, output_ms, steady / steps


def decode_engine(folder: str, p: dict, backend: str):
    """One engine for every batch of the decode stage: a token bucket per batch size, and a
    budget that prefills a batch in a few steps (with a budget of B, as the 2026-12-04 probe
    had, the last prompt starts hundreds of steps after the first and the early ones finish
    before the batch is ever steady). Returns (engine, tokens each request may write)."""
    from jaxkv import LLM
    b = max(p["batches"])
    budget = max(b, min(b * p["prompt_len"], 4096))
    most = p["decode_tokens"] + 2 * -(-b * p["prompt_len"] // budget) + 8 + 2 * p["k"]  # none ends
    llm = LLM(model=folder, load_format="dummy", attention_backend=backend, num_scheduler_steps=p["k"],
              max_model_len=p["prompt_len"] + most, max_num_seqs=b, max_num_batched_tokens=budget,
              token_buckets=tuple(sorted({*p["batches"], budget})), enable_prefix_caching=False,
              kv_cache_memory_bytes=p["kv"], scan_layers=p["scan"])
    return llm, most


def decode_row(llm, most: int, cfg: dict, b: int, p: dict, rows: Rows, launch: bool = True) -> None:
    """Batch `b`'s row, on the decode stage's engine. `launch` False: the step run ahead is
    dispatched on the engine thread instead of the launcher's (ModelRunner.launch_ahead;
    jaxkv/runner/launcher.py), the side-by-side row."""
    import jax
    runner, n = llm.llm_engine.runner, p["decode_tokens"]
    runner.launch_ahead = launch
    ps = prompts(np.random.default_rng(b), b, p["prompt_len"], cfg["vocab_size"])
    rep = p["repetition_penalty"]
    steady_decode(llm.llm_engine, ps, 2, "warm", most, repetition_penalty=rep)  # the sampler's programs compile here
    dt, used, host_ms, steps, output_ms, steady = steady_decode(llm.llm_engine, ps, n, "run", most,
                                                                repetition_penalty=rep)
    context = min(p["prompt_len"] + 32, llm.llm_engine.max_model_len - 1)  # the 12-04 probe's 160
    step_ms, dispatch_ms = device_step(llm, b, context, p["reps"], cfg["vocab_size"])
    rows.add(stage="decode", batch=b, engine_ms_per_step=round(1e3 * dt / n, 3),
             tok_per_s=round(b * n / dt, 1), steps_dispatched_ahead=round(used, 3),
             steps_steady=round(steady, 3),
             host_cpu_ms_per_step=round(host_ms, 3), output_cpu_ms_per_step=round(output_ms, 3),
             num_scheduler_steps=p["k"], engine_steps=steps, repetition_penalty=rep,
             launched=launch and runner.launcher is not None,
             device_step_ms=round(step_ms, 3), dispatch_ms=round(dispatch_ms, 3),
             engine_over_device=round(1e3 * dt / n / step_ms, 2), hlo_moves=step_moves(runner, b, p["k"]),
             fused_projections=runner.model.fused_projections, scan_layers=runner.model.scan_layers,
             scan_unroll=runner.model.scan_unroll, xla_options=runner.step_options,
             device=str(jax.devices()[0]))


def step_moves(runner, t: int, k: int = 1) -> dict | None:
    """What the step program of token bucket `t` (multi-step decode's k-step one when k > 1;
    the decode-only one where there is one) moves without computing, values of 1 MiB or more
    (benchmarks/hlo_values.moves: copies, concatenations, transposes made every step); None
    when that program is not compiled."""
    from benchmarks.hlo_values import large_values, moves
    programs = runner.multi_step.compiled if k > 1 else runner.programs.step
    exe = programs.get((t, True)) or programs.get((t, False))
    return None if exe is None else moves(large_values(exe.as_text(), 1 << 20))


def trace_row(llm, cfg: dict, p: dict, rows: Rows, batch: int) -> None:
    """A profiler trace of `trace_steps` steady decode steps at `batch` (its prefill outside)."""
    import jax
    ps = prompts(np.random.default_rng(7), batch, p["prompt_len"], cfg["vocab_size"])
    where = tempfile.mkdtemp(prefix="jaxkv-trace-")
    most = llm.llm_engine.max_model_len - p["prompt_len"]
    steady_decode(llm.llm_engine, ps, p["trace_steps"], "t", most,
                  lambda: jax.profiler.trace(where, create_perfetto_trace=True))
    ks = trace_kernels.load_kernels(where)
    rows.add(stage="trace", batch=batch, decode_steps=p["trace_steps"],
             **trace_kernels.gpu_idle(ks, p["trace_steps"]), **trace_kernels.kernel_mix(ks, p["trace_steps"]))
    shutil.rmtree(where, ignore_errors=True)


def offline_engine(folder: str, p: dict, rows: Rows, backend: str):
    """The offline workload's engine, built cold (default token buckets); its warmup row."""
    from jaxkv import LLM
    t0 = time.perf_counter()
    buckets = ({"token_buckets": p["token_buckets"], "max_num_batched_tokens": p["token_buckets"][-1]}
               if p["token_buckets"] else {})
    llm = LLM(model=folder, load_format="dummy", attention_backend=backend,
              max_model_len=p["max_model_len"], max_num_seqs=p["max_num_seqs"],
              kv_cache_memory_bytes=p["kv"], **buckets)
    rows.add(stage="warmup", seconds=round(time.perf_counter() - t0, 1),
             programs=llm.stats().num_compilations, compile_threads=llm.llm_engine.runner.compile_workers,
             token_buckets=list(llm.stats().token_buckets))
    return llm


def offline_row(llm, cfg: dict, p: dict, rows: Rows, lengths: tuple) -> None:
    """`lengths`: (shortest prompt, longest prompt, longest output; shortest output = shortest
    prompt)."""
    from jaxkv import SamplingParams
    rng = np.random.default_rng(11)
    lo, hi, out_hi = lengths
    n = p["offline_requests"]
    ps = [{"prompt_token_ids": rng.integers(3, cfg["vocab_size"], int(k)).tolist()}
          for k in rng.integers(lo, hi + 1, n)]
    sps = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=int(k))
           for k in rng.integers(lo, out_hi + 1, n)]
    before, t0 = llm.stats(), time.perf_counter()
    outs = llm.generate(ps, sps, use_tqdm=False)
    dt, after = time.perf_counter() - t0, llm.stats()
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    in_toks = sum(len(x["prompt_token_ids"]) for x in ps)
    steps = max(1, after.num_steps - before.num_steps)
    rows.add(stage="offline", requests=n, seconds=round(dt, 2),
             output_tok_per_s=round(out_toks / dt, 1), total_tok_per_s=round((in_toks + out_toks) / dt, 1),
             preemptions=after.num_preemptions, engine_steps=steps,
             steps_dispatched_ahead=round((after.num_async_steps_used - before.num_async_steps_used) / steps, 3),
             steps_steady=round((after.num_async_steps_steady - before.num_async_steps_steady) / steps, 3),
             host_cpu_ms_per_step=round(1e3 * (after.host_cpu_seconds - before.host_cpu_seconds) / steps, 3))


async def _serve(alm, ps, sp, rate: float) -> tuple[list, list]:
    """TTFT and ITL of each request from the engine's own stamps (RequestMetrics: arrival,
    first token, each output's last token), so the event loop's delivery does not count."""
    async def one(i, x):
        await asyncio.sleep(i / rate)
        stamps, m = [], None
        async for out in alm.generate(x, sp, f"s{i}"):
            m = out.metrics
            stamps.append(m.last_token_time)
        return m.first_token_time - m.arrival_time, list(np.diff(stamps))
    res = await asyncio.gather(*(one(i, x) for i, x in enumerate(ps)))
    return [r[0] for r in res], [g for r in res for g in r[1]]


def serving_row(llm, cfg: dict, p: dict, rows: Rows) -> None:
    """Requests at a fixed rate through AsyncLLM (one token per output, DELTA streams)."""
    from jaxkv import SamplingParams
    from jaxkv.engine.async_llm import AsyncLLM
    from jaxkv.sampling.params import RequestOutputKind
    alm = AsyncLLM(llm.llm_engine, log_stats=False)
    try:
        ps = prompts(np.random.default_rng(13), p["serving_requests"], p["prompt_len"], cfg["vocab_size"])
        sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=p["decode_tokens"],
                            output_kind=RequestOutputKind.DELTA)
        ttft, itl = asyncio.run(_serve(alm, ps, sp, p["serving_rate"]))
    finally:
        alm.shutdown()
    rows.add(stage="serving", requests=len(ps), rate_per_s=p["serving_rate"],
             ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
             itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99))


def memory_rows(llm, rows: Rows) -> None:
    """Each compiled step program's memory_analysis() (issue 38 item 6: peak within weights +
    pool + 4 GiB, no pool-sized temporary), multi-step decode's k-step programs too: GiB of
    arguments, outputs, aliased (donated pool) and temporaries, and the peak they imply
    (arguments + outputs - aliased + temporaries). A program whose temporaries reach a tenth
    of the pool also gets what its optimized HLO holds of that size (benchmarks/hlo_values.py):
    the count of each opcode, and its copies (name, shape, GiB, jax op_name): the cause."""
    import jax
    r = llm.llm_engine.runner
    gib = 2.0 ** -30
    pool = sum(x.nbytes for x in jax.tree.leaves(r.kv_cache))
    multi = r.multi_step.compiled if r.multi_step is not None else {}
    programs = [(key, 1, exe) for key, exe in r.programs.step.items()]
    programs += [(key, r.multi_step.k, exe) for key, exe in multi.items()]
    for (t, decode_only), k, exe in sorted(programs, key=lambda x: x[:2]):
        m = exe.memory_analysis()
        if m is None:  # a backend without the analysis
            continue
        peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        rows.add(stage="memory", token_bucket=t, decode_only=decode_only, num_scheduler_steps=k,
                 argument_gib=round(m.argument_size_in_bytes * gib, 3),
                 output_gib=round(m.output_size_in_bytes * gib, 3),
                 alias_gib=round(m.alias_size_in_bytes * gib, 3),
                 temp_gib=round(m.temp_size_in_bytes * gib, 3), peak_gib=round(peak * gib, 3),
                 weights_gib=round(r.weights_bytes * gib, 3), pool_gib=round(pool * gib, 3),
                 within_4gib=peak <= r.weights_bytes + pool + 4 * 2**30,
                 temp_below_tenth_of_pool=m.temp_size_in_bytes < pool / 10,
                 **(_large_values(exe, pool // 10) if m.temp_size_in_bytes >= pool / 10 else {}))


def _large_values(exe, min_bytes: int) -> dict:
    """A compiled program's values of at least `min_bytes`: {large_opcodes: {opcode: count},
    large_copies: the first 8 copies}."""
    from benchmarks.hlo_values import copies, large_values
    values = large_values(exe.as_text(), min_bytes)
    return {"large_opcodes": dict(collections.Counter(v["opcode"] for v in values)),
            "large_copies": copies(values)[:8]}


SMOKE = {"kv_int8": dict(kv_cache_dtype="int8"), "kv_fp8": dict(kv_cache_dtype="fp8"),
         "ngram_spec": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
         "prefix_hits": dict(enable_prefix_caching=True)}


def smoke_rows(folder: str, cfg: dict, rows: Rows, backend: str) -> None:
    """Each path of SMOKE (and structured outputs with llguidance) on small token buckets:
    the share of sequences whose greedy tokens equal the plain engine's (int8 and fp8 pools
    round the K/V, so theirs may part at near-ties; the others must be 1.0)."""
    import importlib.util

    from jaxkv import LLM, SamplingParams
    rng = np.random.default_rng(17)
    shared = rng.integers(3, cfg["vocab_size"], 32).tolist()  # a common prefix: prefix hits
    ps = [{"prompt_token_ids": shared + rng.integers(3, cfg["vocab_size"], k).tolist()} for k in (3, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(model=folder, load_format="dummy", attention_backend=backend, max_model_len=128,
              max_num_seqs=4, token_buckets=(8, 64), max_num_batched_tokens=64,
              kv_cache_memory_bytes="256MiB", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(ps, sp, use_tqdm=False)]
    for name, extra in SMOKE.items():
        try:
            llm = LLM(**{**kw, **extra})
            got = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
            rows.add(stage="smoke", path=name, ok=True, hits=llm.stats().prefix_cache_hits,
                     tokens_equal=round(sum(a == b for a, b in zip(got, want)) / len(want), 3))
            llm = None
            gc.collect()
        except Exception as e:  # noqa: BLE001 - a path that fails is a row, the rest still run
            rows.add(stage="smoke", path=name, ok=False, error=f"{type(e).__name__}: {e}"[:300])
    if importlib.util.find_spec("llguidance") is None:
        rows.add(stage="smoke", path="structured_outputs", ok=None, error="llguidance not installed")
        return
    from jaxkv.structured_outputs.params import StructuredOutputsParams
    choice = ["<t5> <t6>", "<t9>"]
    so = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choice))
    try:
        text = LLM(**kw).generate(ps[:1], so, use_tqdm=False)[0].outputs[0].text
        rows.add(stage="smoke", path="structured_outputs", ok=text in choice, text=text)
    except Exception as e:  # noqa: BLE001 - e.g. a tokenizer llguidance cannot read
        rows.add(stage="smoke", path="structured_outputs", ok=False, error=f"{type(e).__name__}: {e}"[:300])


def force_projections(fused: bool) -> None:
    """Engines built from now on fuse q/k/v and gate/up (float weights, one device) or keep them
    apart, whatever the platform (jaxkv.engine.setup.fused_projections_wanted): an A/B."""
    from jaxkv.engine import setup
    setup.fused_projections_wanted = lambda rc, mesh: fused and rc.quantization is None and mesh is None


def force_scan_unrolled() -> None:
    """Engines built from now on that scan their layers run the scan fully unrolled
    (LlamaModel.scan_unroll = num_layers): the stacked weights' few argument leaves, each
    layer reading a static slice of them, and no loop: an A/B of the loop itself."""
    from jaxkv.engine import setup
    build = setup.build_model

    def unrolled(config, mesh):
        model = build(config, mesh)
        return model.clone(scan_unroll=model.cfg.num_layers) if model.scan_layers else model
    setup.build_model = unrolled


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "llama3-8b"))
    ap.add_argument("--stages", nargs="+",
                    default=["decode", "trace", "offline", "serving", "smoke", "multistep"])
    ap.add_argument("--cpu-dry-run", action="store_true", help="a tiny model on the CPU (pallas interpreted)")
    ap.add_argument("--batches", type=int, nargs="+", help="the decode stage's batch sizes")
    ap.add_argument("--decode-tokens", type=int, help="the decode stage's N")
    ap.add_argument("--attention-backend", help="default: auto (pallas on the dry run)")
    ap.add_argument("--prompt-len", type=int, help="the decode stage's prompt length")
    ap.add_argument("--kv-cache-memory-bytes", help="each engine's KV pool (default 24GiB)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="the decode stage's multi-step decode k (jaxkv/runner/multi_step.py)")
    ap.add_argument("--repetition-penalty", type=float,
                    help="the decode stage's rows sample with it (1: off; else each reads its history)")
    ap.add_argument("--scan-layers", action="store_true",
                    help="the decode stage's engine runs its layers as one loop (scan_layers)")
    ap.add_argument("--scan-unroll", action="store_true",
                    help="with --scan-layers: that scan fully unrolled (stacked weights, no loop)")
    ap.add_argument("--projections", choices=("auto", "fused", "unfused"), default="auto",
                    help="q/k/v and gate/up weights: the engine's choice (fused on a GPU) or forced")
    a = ap.parse_args(argv)
    if a.projections != "auto":
        force_projections(a.projections == "fused")
    if a.scan_unroll:
        force_scan_unrolled()
    p, backend = (DRY, "pallas") if a.cpu_dry_run else (FULL, "auto")
    given = (("batches", a.batches), ("decode_tokens", a.decode_tokens),
             ("prompt_len", a.prompt_len), ("kv", a.kv_cache_memory_bytes), ("k", a.num_scheduler_steps),
             ("repetition_penalty", a.repetition_penalty), ("scan", a.scan_layers or None))
    p = {**p, **{k: v for k, v in given if v is not None}}
    backend = a.attention_backend or backend
    os.environ.setdefault("JAXKV_COMPILATION_CACHE", "0")  # the warmup row: a cold start
    if a.cpu_dry_run:
        cfg = TINY_CONFIG
    else:
        with open(os.path.join(a.config, "config.json")) as f:
            cfg = json.load(f)
    lengths = (4, 32, 24) if a.cpu_dry_run else (32, 512, 384)
    rows, tmp = Rows("5_gpu_engine"), tempfile.mkdtemp(prefix="jaxkv-gpu-engine-")
    try:
        folder = model_folder(cfg, tmp)
        if "decode" in a.stages:
            llm, most = decode_engine(folder, p, backend)
            freeze_startup_heap()  # as `jaxkv serve` does (jaxkv/engine/gc_heap.py)
            for b in p["batches"]:
                decode_row(llm, most, cfg, b, p, rows, launch=False)  # side by side:
                decode_row(llm, most, cfg, b, p, rows)  # the step run ahead launched or not
                if "trace" in a.stages and b == (128 if 128 in p["batches"] else p["batches"][-1]):
                    trace_row(llm, cfg, p, rows, b)
            llm = None
            release_frozen_heap()  # LLM holds reference cycles: its device memory goes only now
        if "offline" in a.stages or "serving" in a.stages:
            llm = offline_engine(folder, p, rows, backend)
            freeze_startup_heap()
            if "offline" in a.stages:
                offline_row(llm, cfg, p, rows, lengths)
            if "serving" in a.stages:
                serving_row(llm, cfg, p, rows)
            memory_rows(llm, rows)  # the programs compiled by now (all but a cut background)
            llm.llm_engine.shutdown()  # a background compile still running would keep it alive
            llm = None
            release_frozen_heap()  # its device memory too, before the next engine (an H100's 80 GB)
        if "smoke" in a.stages:  # on the model's first 2 layers: the paths, not the speed
            small = {**cfg, "num_hidden_layers": min(2, cfg["num_hidden_layers"])}
            smoke_rows(model_folder(small, os.path.join(tmp, "small")), small, rows, backend)
            gc.collect()
        if "multistep" in a.stages:  # the decode rows again, multi-step decode's k on
            q = {**p, "k": p["multi_k"], "batches": p["batches"][-2:]}
            llm, most = decode_engine(folder, q, backend)
            for b in q["batches"]:
                decode_row(llm, most, cfg, b, q, rows)
            memory_rows(llm, rows)  # its k-step programs' among them
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
