"""KV cache dtype: capacity, throughput and fidelity of each pool dtype in the same memory.

The embedded SmolLM2-135M-Instruct (float32 weights, prefix caching off) is built once per
kv_cache_dtype (auto = float32, bfloat16, int8, fp8_e4m3) with the same KV budget (64 MiB;
quick: 32 MiB), small enough that a float32 pool cannot hold the whole batch at once. Each
engine gets the same requests (random prompts, greedy, ignore_eos, logprobs 5) in one
LLM.generate call, after an untimed warmup request. Reported per dtype: blocks and tokens in
the budget, output tokens/s of the generate call, the most requests running at once, the
preemptions, and against the float32 pool's outputs: how many outputs are token for token
equal and the mean |first-token logprob difference| over the top-5 entries both returned.
The pool dtype buys concurrency: a narrower pool holds more sequences in the same memory.
"""

from __future__ import annotations

import time

import numpy as np
from common import base_parser, print_table, random_prompts, save

MIB = 2**20
DTYPES = ("auto", "bfloat16", "int8", "fp8")


def run(kv_cache_dtype, budget, prompts, max_tokens, seed):
    from jaxkv import LLM, SamplingParams
    llm = LLM(kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=budget, max_model_len=1024,
              enable_prefix_caching=False, seed=seed)
    llm.llm_engine.wait_for_background_compile()
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)  # untimed warmup
    eng, peak = llm.llm_engine, [0]
    step = eng.step

    def counting_step():
        peak[0] = max(peak[0], len(eng.scheduler.running))
        return step()
    eng.step = counting_step
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    s = llm.stats()
    return outs, {"kv_cache_dtype": kv_cache_dtype, "pool_dtype": eng.config.runner.kv_cache_dtype,
                  "blocks": s.num_total_blocks,
                  "tokens": s.num_total_blocks * eng.config.cache.block_size,
                  "tok_per_s": len(prompts) * max_tokens / wall, "peak_running": peak[0],
                  "preemptions": s.num_preemptions - before.num_preemptions}


def fidelity(outs, ref):
    equal = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, ref))
    diffs = [abs(a.outputs[0].logprobs[0][t].logprob - lp.logprob)
             for a, b in zip(outs, ref) for t, lp in b.outputs[0].logprobs[0].items()
             if t in a.outputs[0].logprobs[0]]
    return equal, float(np.mean(diffs))


def main():
    p = base_parser("Capacity, throughput and fidelity of each KV cache dtype in one budget",
                    "16 requests of 64-96 prompt tokens and 32 output tokens, 32 MiB "
                    "(full: 32 requests of 96-160 prompt tokens and 64 output tokens, 64 MiB)")
    args = p.parse_args()
    t_start = time.perf_counter()
    num, lo, hi, max_tokens, budget = (16, 64, 96, 32, 32 * MIB) if args.quick else \
        (32, 96, 160, 64, 64 * MIB)
    prompts = random_prompts(np.random.default_rng(args.seed), num, lo, hi)
    rows, ref = [], None
    for dt in DTYPES:
        outs, row = run(dt, budget, prompts, max_tokens, args.seed)
        ref = ref or outs
        row["outputs_equal"], row["mean_abs_logprob_diff"] = fidelity(outs, ref)
        rows.append(row)
        print(f"{dt}: {row['tokens']:,} tokens, {row['tok_per_s']:.1f} tok/s", flush=True)
    for r in rows:
        r["throughput_vs_float32"] = r["tok_per_s"] / rows[0]["tok_per_s"]
        r["outputs_equal"] = f"{r['outputs_equal']}/{num}"
    print_table(rows, ["kv_cache_dtype", "pool_dtype", "blocks", "tokens", "peak_running",
                       "preemptions", "tok_per_s", "throughput_vs_float32", "outputs_equal",
                       "mean_abs_logprob_diff"], floatfmt="{:.3f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [r["kv_cache_dtype"] for r in rows]
    ax.bar(names, [r["tok_per_s"] for r in rows], color="#4878a8")
    for i, r in enumerate(rows):
        ax.text(i, r["tok_per_s"], f"{r['tokens']:,} tok\n{r['peak_running']} running",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{num} requests, KV budget {budget // MIB} MiB, SmolLM2-135M fp32 weights")
    ax.margins(y=0.25)
    data = {"rows": rows, "budget_bytes": budget, "requests": num, "max_tokens": max_tokens,
            "seconds": time.perf_counter() - t_start}
    save("kv_cache_dtype", data, args, fig)


if __name__ == "__main__":
    main()
