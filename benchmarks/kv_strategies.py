"""Seed 000 section 5.2 on jaxkv: one Flax model (the embedded SmolLM2-135M-Instruct, float32),
one workload, three ways of handling the KV cache.

  naive   no KV cache: every new token re-runs the whole sequence (prompt + output so far)
          of every unfinished request, batched: the sequences are packed into rows of 128k
          tokens (causal within each sequence), so little is spent on padding.
  static  a contiguous KV region of max_model_len slots per request ([batch, max_model_len,
          kv_heads, head_dim] per layer, updated with dynamic_update_slice, donated); prompts
          left-padded to a multiple of 64 and prefilled together, then the static batch
          decodes until its slowest member is done; attention reads only the filled part,
          rounded up to 64 slots (one compiled program per span).
  paged   jaxkv's LLM.generate: paged KV (16-token blocks) + continuous batching.
paged and static get the same KV memory (--kv-budget-mib, default 256 MiB): paged's pool,
and static's batch = budget / (max_model_len x 46,080 bytes per token) = 5 requests at 1024.
An extra row, static_unbounded, runs all requests as one static batch, ignoring the budget.
naive and static are plain JAX over the engine's own weights (same RoPE, RMSNorm, tied
logits), one jitted program per shape, greedy; outputs are compared with paged's.

Measured per strategy, in one run: mean TPOT (ms, per request (e2e - ttft) / (out - 1),
token times as streamed; every request arrives at the start), output tokens/s (output tokens /
wall time of the measured call, after an untimed warmup that compiles every shape the call
uses), both relative to naive; KV utilization at peak (tokens whose K/V is stored / slots
reserved, at the step holding most tokens: static reserves batch x max_model_len, paged the
blocks of running requests x 16, read from the engine after every step; naive stores no K/V:
null); and how many requests of this workload fit the KV budget at once (static:
budget / (max_model_len x bytes/token); paged: usable blocks / mean blocks a request needs
at its full length; naive: null). The static figures scale with --max-model-len (reported).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from common import base_parser, print_table, random_prompts, save
from dense_llama import Dense

PAD = 64  # naive/static length bucket (tokens)
WORKLOADS = {"8req": (8, (64, 256), (32, 128)), "32req": (32, (64, 256), (32, 128)),
             "quick-8req": (8, (32, 128), (16, 48))}


def rup(n: int, m: int = PAD) -> int:
    return -(-n // m) * m


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def pack(seqs, act, n):
    """First-fit-decreasing packing of the active sequences into rows of W tokens
    (W = longest rounded up to 128; row count rounded up to even above 4)."""
    w = rup(max(len(seqs[i]) for i in act), 128)
    rows = []
    for i in sorted(act, key=lambda i: -len(seqs[i])):
        row = next((r for r in rows if r[0] + len(seqs[i]) <= w), None)
        if row is None:
            rows.append(row := [0, []])
        row[0] += len(seqs[i])
        row[1].append(i)
    nr = len(rows) if len(rows) <= 4 else rup(len(rows), 2)
    ids, seg, pos = (np.zeros((nr, w), np.int32) for _ in range(3))
    last = np.zeros((n, 2), np.int32)
    for r, (_, idx) in enumerate(rows):
        off = 0
        for j, i in enumerate(idx):
            ln = len(seqs[i])
            ids[r, off:off + ln], seg[r, off:off + ln], pos[r, off:off + ln] = seqs[i], j + 1, np.arange(ln)
            last[i] = (r, off + ln - 1)
            off += ln
    return ids, seg, pos, last


def run_naive(dn, prompts, outs, warm=False):
    """Returns (seconds, per-request token times, tokens, programs). warm: compile only."""
    n = len(prompts)
    seqs = [list(p) for p in prompts]
    times = [[] for _ in range(n)]
    lens0 = [len(p) for p in prompts]
    shapes, t0 = set(), time.perf_counter()
    while True:
        act = [i for i in range(n) if len(seqs[i]) - lens0[i] < outs[i]]
        if not act:
            break
        x = (dn.stacked, dn.params, *pack(seqs, act, n))
        key = (x[2].shape, n)  # programs differ by packed shape and by request count
        shapes.add(key)
        if warm:  # compile ahead of time, without running (a run of a big shape costs seconds)
            if key not in dn.naive_exe:
                dn.naive_exe[key] = dn.naive.lower(*x).compile()
        else:
            tok = np.asarray(dn.naive_exe[key](*x))
        now = time.perf_counter()
        for i in act:
            seqs[i].append(0 if warm else int(tok[i]))
            times[i].append(now - t0)
    return time.perf_counter() - t0, times, [s[l:] for s, l in zip(seqs, lens0)], len(shapes)


def run_static(dn, prompts, outs, max_len, batch, warm=False):
    """Static batches over `batch` reserved regions of max_len slots, FCFS; a short last batch
    keeps the same slots (padding rows). Returns (seconds, token times, tokens, peak
    utilization, programs). warm: compile only."""
    c, n = dn.c, len(prompts)
    times, toks, peak, spans = [[] for _ in prompts], [[] for _ in prompts], (0, 0.0), set()
    shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)  # reserved once, up front
    cache = (jnp.zeros(shape, dn.model.dtype), jnp.zeros(shape, dn.model.dtype))
    t0 = time.perf_counter()
    for s in range(0, n, batch):
        idx = list(range(s, min(s + batch, n)))
        tp, steps = rup(max(len(prompts[i]) for i in idx)), max(outs[i] for i in idx)
        assert tp + steps - 1 <= max_len, "max_model_len too small for this workload"
        ids, pad = np.zeros((batch, tp), np.int32), np.full(batch, tp - 1, np.int32)
        for r, i in enumerate(idx):
            pad[r] = tp - len(prompts[i])
            ids[r, pad[r]:] = prompts[i]
        tok, cache = dn.prefill(dn.params, ids, cache, pad)
        for j in range(steps):
            if j:
                span = rup(tp + j)
                if warm and span in spans:
                    continue
                spans.add(span)
                tok, cache = dn.decode(dn.params, tok, cache, pad, np.int32(tp + j - 1), span=span)
            if warm:
                jax.block_until_ready(tok)
                continue
            host, now = np.asarray(tok), time.perf_counter()
            for r, i in enumerate(idx):
                if j < outs[i]:
                    toks[i].append(int(host[r]))
                    times[i].append(now - t0)
            held = sum(len(prompts[i]) + min(j, outs[i] - 1) for i in idx)  # K/V written, real tokens
            peak = max(peak, (held, held / (batch * max_len)))
    return time.perf_counter() - t0, times, toks, peak[1], len(spans) + 1


def run_paged(llm, prompts, outs):
    """LLM.generate with a probe after every engine step: (tokens held, block slots held)."""
    from jaxkv import SamplingParams
    eng, probes = llm.llm_engine, []
    step = eng.step

    def probed():
        o = step()
        sch = eng.scheduler
        probes.append((sum(r.num_computed_tokens for r in sch.running),
                       sum(len(sch.kv.get_block_ids(r.request_id)) for r in sch.running) * sch.kv.block_size))
        return o
    eng.step = probed
    sps = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    secs = time.perf_counter() - t0
    del eng.step
    held, slots = max(probes)
    tpot = [(m.last_token_time - m.first_token_time) / (len(r.outputs[0].token_ids) - 1)
            for r in res for m in [r.metrics]]
    return secs, tpot, [list(r.outputs[0].token_ids) for r in res], held / slots


def tpots(times):
    return [(t[-1] - t[0]) / (len(t) - 1) for t in times]


def run_variant(name, llm, dn, args):
    from jaxkv import SamplingParams
    from jaxkv.core.kv_budget import bytes_per_token
    n, (plo, phi), (olo, ohi) = WORKLOADS[name]
    rng = np.random.default_rng((args.seed, list(WORKLOADS).index(name)))  # each workload fixed alone
    prompts = random_prompts(rng, n, plo, phi)
    outs = rng.integers(olo, ohi + 1, size=n).tolist()
    total_out, L, c = sum(outs), args.max_model_len, dn.c
    bpt = bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, jnp.dtype(dn.model.dtype).itemsize)
    budget, bs = args.kv_budget_mib * 2**20, llm.llm_engine.scheduler.kv.block_size
    mean_blocks = np.mean([-(-(len(p) + o) // bs) for p, o in zip(prompts, outs)])
    batch = args.static_batch or max(1, budget // (L * bpt))
    print(f"\n[{name}] {n} requests, prompts {plo}-{phi}, outputs {olo}-{ohi} ({total_out} tokens), "
          f"max_model_len {L}, KV budget {args.kv_budget_mib} MiB: static batch {batch}")
    # warmups: compile every shape each measured call will use (not timed)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    w = time.perf_counter()
    n_naive = run_naive(dn, prompts, outs, warm=True)[3]
    n_static = sum(run_static(dn, prompts, outs, L, b, warm=True)[4] for b in {batch, n})
    print(f"  warmup: {n_naive} naive + {n_static} static programs in {time.perf_counter() - w:.1f} s")
    r, pre = {}, llm.llm_engine.scheduler.num_preemptions
    secs, pt, ptok, util = run_paged(llm, prompts, outs)
    r["paged"] = {"secs": secs, "tpot": pt, "toks": ptok, "util": util,
                  "conc": int((budget // (bs * bpt) - 1) / mean_blocks),
                      "preemptions": llm.llm_engine.scheduler.num_preemptions - pre}  # minus jaxkv's null block
    for k, b in (("static", batch), ("static_unbounded", n)):
        secs, tt, stok, util, _ = run_static(dn, prompts, outs, L, b)
        r[k] = {"secs": secs, "tpot": tpots(tt), "toks": stok, "util": util,
                "conc": int(budget // (L * bpt)), "batch": b}
    secs, tt, ntok, _ = run_naive(dn, prompts, outs)
    r["naive"] = {"secs": secs, "tpot": tpots(tt), "toks": ntok, "util": None, "conc": None}
    base_tps, base_tpot = total_out / r["naive"]["secs"], float(np.mean(r["naive"]["tpot"]))
    strategies, rows = {}, []
    for k in ("naive", "static", "paged", "static_unbounded"):
        v = r[k]
        tps, tpot = total_out / v["secs"], float(np.mean(v["tpot"]))
        same = sum(a == b for a, b in zip(v["toks"], ptok))
        strategies[k] = {"tpot_ms": 1e3 * tpot, "output_tok_s": tps, "rel_tpot": tpot / base_tpot,
                         "rel_output_tok_s": tps / base_tps, "kv_utilization": v["util"],
                         "max_concurrency": v["conc"], "wall_s": v["secs"], "same_tokens_as_paged": f"{same}/{n}",
                         **{x: v[x] for x in ("batch", "preemptions") if x in v}}
        rows.append({"strategy": k, **{c_: strategies[k][c_] for c_ in
                     ("tpot_ms", "rel_tpot", "output_tok_s", "rel_output_tok_s", "kv_utilization",
                      "max_concurrency", "wall_s", "same_tokens_as_paged")}})
    print_table(rows)
    print("  static_unbounded: one static batch of all requests, ignoring the KV budget "
          f"(it reserves {n * L * bpt / 2**20:.0f} MiB)")
    return {"variant": name, "max_model_len": L, "static_batch": batch, "num_requests": n,
            "output_tokens": total_out, "bytes_per_token": int(bpt), "kv_budget_bytes": budget,
            "strategies": strategies}


def verdict(v, quick):
    s = v["strategies"]
    p, st, nv = s["paged"], s["static"], s["naive"]
    checks = [("paged throughput >= 10x naive", p["output_tok_s"] / nv["output_tok_s"], 10),
              ("paged throughput >= 2x static", p["output_tok_s"] / st["output_tok_s"], 2),
              (f"paged KV utilization >= {0.90 if quick else 0.95:.2f}", p["kv_utilization"], 0.90 if quick else 0.95),
              ("paged concurrency >= 3x static", p["max_concurrency"] / max(st["max_concurrency"], 1), 3)]
    note = "; the throughput and concurrency targets are set for the full workload" if quick else ""
    print(f"targets [{v['variant']}] (static KV utilization {st['kv_utilization']:.2f}, seed ~0.30{note}):")
    for what, got, need in checks:
        print(f"  {'MET ' if got >= need else 'SHORT'} {what}: {got:.2f}")


def plot(results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [("output_tok_s", "output tokens/s"), ("tpot_ms", "mean TPOT (ms)"),
            ("kv_utilization", "KV utilization at peak"),
            ("max_concurrency", f"requests in {results[0]['kv_budget_bytes'] >> 20} MiB KV")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    names, width = ("naive", "static", "paged"), 0.8 / len(results)
    for ax, (k, label) in zip(axes, keys):
        for j, v in enumerate(results):
            ys = [v["strategies"][s][k] for s in names]
            ax.bar(np.arange(3) + j * width, [y or 0 for y in ys], width, label=v["variant"])
            for x, y in zip(np.arange(3) + j * width, ys):
                ax.annotate("n/a" if y is None else f"{y:.0f}" if y >= 100 else f"{y:.3g}", (x, y or 0), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(np.arange(3) + width * (len(results) - 1) / 2, names)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"KV strategies, SmolLM2-135M fp32, max_model_len {results[0]['max_model_len']}", y=1.04)
    return fig


def main():
    p = base_parser("Seed 000 section 5.2 on jaxkv: naive (no KV cache) vs static (max_model_len "
                    "reserved per request) vs paged KV + continuous batching, same model and workload; "
                    "a full run (no --quick) takes tens of minutes, mostly naive", "8 requests, prompts 32-128 tokens, outputs 16-48 "
                    "(full: 8 requests, prompts 64-256, outputs 32-128, then the same with 32 requests)")
    p.add_argument("--variant", choices=["8req", "32req", "both"], default="both",
                   help="full-mode workloads to run (default both, 8req first; ignored with --quick)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="context limit of every strategy: static reserves this many slots per request")
    p.add_argument("--kv-budget-mib", type=int, default=256,
                   help="KV memory of paged's pool and static's reserved regions (static batch = "
                        "budget / (max_model_len x bytes per token)), and of the concurrency column")
    p.add_argument("--static-batch", type=int, default=0, help="override the static batch size")
    args = p.parse_args()
    from jaxkv import LLM
    t0 = time.perf_counter()
    llm = LLM(max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_budget_mib * 2**20,
              enable_prefix_caching=False, seed=args.seed)
    llm.llm_engine.wait_for_background_compile()  # time the steady state
    runner = llm.llm_engine.runner
    dn = Dense(runner.model, runner.params)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s")
    names = ["quick-8req"] if args.quick else (["8req", "32req"] if args.variant == "both" else [args.variant])
    results = [run_variant(nm, llm, dn, args) for nm in names]
    print()
    for v in results:
        verdict(v, args.quick)
    data = {"variant": results[0]["variant"],
            "strategies": {k: {c: v for c, v in s.items() if c in (
                "tpot_ms", "output_tok_s", "rel_tpot", "rel_output_tok_s", "kv_utilization", "max_concurrency")}
                for k, s in results[0]["strategies"].items() if k in ("naive", "static", "paged")},
            "variants": results, "seconds": time.perf_counter() - t0}
    save("kv_strategies", data, args, plot(results))


if __name__ == "__main__":
    main()
