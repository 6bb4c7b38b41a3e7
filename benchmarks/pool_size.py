"""Decode step time against KV pool size: the pool is donated to the jitted step, so XLA updates
it in place and a 4x larger pool must not make a step slower (target: at most 10%).

Two engines (the embedded SmolLM2-135M-Instruct, float32, max_model_len 1024, prefix caching
off) are built with kv_cache_memory_bytes 256 MiB and 1 GiB (364 and 1,456 blocks of 16
tokens). Each gets the same 32 requests (random prompts of the same lengths, ignore_eos) and
steps until all 32 are decoding; then the scheduler's next step (32 decode tokens, token
bucket 64) is packed once and the engine's jitted step (runner.forward: the AOT-compiled
program with the pool donated) is timed alone, block_until_ready after each call, in rounds
that alternate the two engines so machine noise hits both alike. Reported: the median step
(ms) per pool and their ratio. Control: the same step jitted WITHOUT donation on the large pool
(XLA must then copy the pool every step), showing what a copy would cost.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from common import base_parser, print_table, random_prompts, save

MIB = 2**20
SMALL, LARGE = 256 * MIB, 1024 * MIB
BATCH, MAX_MODEL_LEN = 32, 1024


def decoding_engine(pool_bytes, prompts, seed):
    """An engine whose scheduler holds len(prompts) requests, all past their prefill."""
    from jaxkv import LLM, SamplingParams
    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=pool_bytes,
              enable_prefix_caching=False, seed=seed)
    llm.llm_engine.wait_for_background_compile()  # time the steady state
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    while any(not r.output_token_ids for r in eng.scheduler.requests.values()):
        eng.step()
    return llm


def decode_step(llm):
    """The packed inputs of the next step (all decodes) and a function running the jitted step."""
    eng = llm.llm_engine
    out, runner = eng.scheduler.schedule(), eng.runner
    assert len(out.scheduled) == BATCH and out.total_num_scheduled_tokens == BATCH, "not a pure decode step"
    si = runner.build_inputs(out)
    ctx = int(si.seq_lens.sum())

    def run():  # rewrites the same slots every call: the pool's contents do not matter here
        t0 = time.perf_counter()
        jax.block_until_ready(runner.forward(si))
        return time.perf_counter() - t0

    def copied():  # control: the same step without donation (a fresh pool each call)
        t0 = time.perf_counter()
        hidden, kv = nodonate(runner.params, runner.kv_cache, si)
        jax.block_until_ready((hidden, kv))
        return time.perf_counter() - t0
    nodonate = jax.jit(runner.step_fn)
    return run, copied, ctx, si.num_tokens


def main():
    p = base_parser("Jitted decode step time with KV pools of 256 MiB and 1 GiB (the pool is donated, "
                    "so the larger pool must not slow a step)", "32 sequences with 64-token prompts, 3 rounds x 10 steps per pool "
                    "(full: 128-token prompts, 10 rounds x 20 steps)")
    args = p.parse_args()
    t_start = time.perf_counter()
    plen, rounds, reps = (64, 3, 10) if args.quick else (128, 10, 20)
    prompts = random_prompts(np.random.default_rng(args.seed), BATCH, plen, plen)
    engines = {}
    for name, size in (("small", SMALL), ("large", LARGE)):
        t0 = time.perf_counter()
        llm = decoding_engine(size, prompts, args.seed)
        run, copied, ctx, bucket = decode_step(llm)
        run()  # first call of this program in the process
        engines[name] = {"llm": llm, "run": run, "copied": copied,
                         "blocks": llm.llm_engine.config.cache.num_blocks, "times": []}
        print(f"{name} pool: {size // MIB} MiB, {engines[name]['blocks']} blocks, ready in "
              f"{time.perf_counter() - t0:.1f} s")
    print(f"decode step: {BATCH} sequences, {ctx} context tokens, token bucket {bucket}; "
          f"{rounds} rounds x {reps} steps per pool")
    for _ in range(rounds):
        for e in engines.values():
            e["times"] += [e["run"]() for _ in range(reps)]
    t0 = time.perf_counter()
    engines["large"]["copied"]()  # compile the control
    print(f"control compiled in {time.perf_counter() - t0:.1f} s")
    control = [engines["large"]["copied"]() for _ in range(max(5, reps // 2))]

    def row(label, size, blocks, ts):
        ms = 1e3 * np.asarray(ts)
        return {"pool": label, "MiB": size // MIB, "blocks": blocks, "median_ms": float(np.median(ms)),
                "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)), "steps": len(ms)}
    rows = [row("small", SMALL, engines["small"]["blocks"], engines["small"]["times"]),
            row("large", LARGE, engines["large"]["blocks"], engines["large"]["times"]),
            row("large, no donation (control)", LARGE, engines["large"]["blocks"], control)]
    print_table(rows)
    small, large = rows[0]["median_ms"], rows[1]["median_ms"]
    ratio = large / small
    print(f"{'MET ' if ratio <= 1.10 else 'SHORT'} 4x larger pool slows a decode step by at most 10%: "
          f"ratio {ratio:.3f}; a copied pool would cost {rows[2]['median_ms'] / large:.2f}x")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.8))
    series = [engines["small"]["times"], engines["large"]["times"], control]
    ax.boxplot([1e3 * np.asarray(s) for s in series], showfliers=True)
    ax.set_xticks([1, 2, 3], [f"{SMALL // MIB} MiB", f"{LARGE // MIB} MiB", f"{LARGE // MIB} MiB\nno donation"])
    ax.set_ylabel("decode step (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Jitted decode step, {BATCH} sequences, SmolLM2-135M fp32: ratio {ratio:.3f}")
    data = {"step_ms_small_pool": small, "step_ms_large_pool": large, "ratio": ratio,
            "step_ms_large_pool_no_donation": rows[2]["median_ms"], "small_pool_bytes": SMALL,
            "large_pool_bytes": LARGE, "batch": BATCH, "context_tokens": ctx, "token_bucket": bucket,
            "rows": rows, "seconds": time.perf_counter() - t_start}
    save("pool_size", data, args, fig)


if __name__ == "__main__":
    main()
