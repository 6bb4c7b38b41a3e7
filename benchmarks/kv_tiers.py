"""The KV cache's lower tiers on a multi-turn workload: what host memory and disk save.

16 conversations of 6 turns (--quick: 6 of 3), each over its own 1,500-token document
(--quick: 800), visited round-robin: turn t of every conversation, then turn t + 1. A turn's
prompt is the document, the earlier questions and the model's answers, and a new 16-token
question; the model answers in 16 greedy tokens, one request at a time. The device pool holds
about 4 conversations, so by the time a conversation comes round again its blocks have been
evicted from the device. Four runs, each in a process of its own on the embedded SmolLM2:

  device only        the pool alone: every evicted block is computed again;
  device + host      swap_space large enough for every conversation;
  device + host + disk  a host tier for about 4 conversations and a disk tier for all;
  restart, warm disk a new process on the disk tier the previous run left: the first turn
                     of every conversation (what a restarted server sees first).

For each: prompt tokens computed (run through the model; also after the first turns, which
every run computes in full), TTFT p50 / p99 and the total time.
Targets (issue 13): with the host tier, prompt tokens computed <= 10% of device only and TTFT
p50 <= 0.5x; after the restart, the first turn of each conversation computes <= 10% of its
prompt. Same-run ratios; the machine is recorded with the result.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from common import base_parser, print_table, save

QUESTION, ANSWER = 16, 16


def child(mode: str, disk_dir: str, convs: int, turns: int, doc_len: int, seed: int) -> dict:
    from jaxkv import LLM, SamplingParams
    max_len = doc_len + turns * (QUESTION + ANSWER) + 64
    conv_blocks = -(-max_len // 16)
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2 float32: layers x K,V x heads x dim x bytes x tokens
    gib = lambda blocks: blocks * block_bytes / 2**30  # noqa: E731
    kw = dict(max_model_len=max_len, num_gpu_blocks_override=4 * conv_blocks + 1, max_num_seqs=8,
              token_buckets=(1, 8, 64, 512))  # all compiled at warmup: no background compile
    if mode == "host":
        kw.update(swap_space=gib(convs * conv_blocks + 16))
    elif mode in ("disk", "restart"):
        kw.update(swap_space=gib(4 * conv_blocks), kv_cache_disk_dir=disk_dir,
                  kv_cache_disk_bytes=int((convs + 1) * conv_blocks * (block_bytes + 8)))
    llm = LLM(**kw)
    llm.llm_engine.wait_for_background_compile()
    rng = np.random.default_rng(seed)
    docs = [rng.integers(100, 49152, doc_len).tolist() for _ in range(convs)]
    questions = [[rng.integers(100, 49152, QUESTION).tolist() for _ in range(turns)] for _ in range(convs)]
    history = [list(d) for d in docs]
    sp = SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True)
    ttft, fracs, computed = [], [], []
    t0 = time.perf_counter()
    for t in range(1 if mode == "restart" else turns):
        for c in range(convs):
            prompt = history[c] + questions[c][t]
            before = llm.stats().num_computed_prompt_tokens
            o = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
            computed.append(llm.stats().num_computed_prompt_tokens - before)
            fracs.append(computed[-1] / len(prompt))
            ttft.append(o.metrics.first_token_time - o.metrics.arrival_time)
            history[c] = prompt + list(o.outputs[0].token_ids)
    total = time.perf_counter() - t0
    s = llm.stats()
    return {"mode": mode, "computed_tokens": s.num_computed_prompt_tokens,
            "prompt_tokens": s.num_prompt_tokens, "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "total_s": total,
            "first_turn_computed_frac": float(np.mean(fracs[:convs])),
            "computed_after_first_turn": int(sum(computed[convs:])),
            "host_hit_tokens": s.kv_offload_host_hit_tokens, "disk_hit_tokens": s.kv_offload_disk_hit_tokens,
            "preemptions": s.num_preemptions, "device_blocks": s.num_total_blocks,
            "host_blocks": s.kv_offload_host_blocks, "disk_blocks": s.kv_offload_disk_blocks,
            "answers": [h[-ANSWER:] for h in history]}


def main():
    p = base_parser("Prompt tokens computed and TTFT with the KV cache's host and disk tiers",
                    "6 conversations of 3 turns over 800-token documents")
    p.add_argument("--child", default=None, help=argparse_hidden())
    p.add_argument("--disk-dir", default=None, help=argparse_hidden())
    args = p.parse_args()
    convs, turns, doc_len = (6, 3, 800) if args.quick else (16, 6, 1500)
    if args.child:
        r = child(args.child, args.disk_dir, convs, turns, doc_len, args.seed)
        print("TIER_ROW " + json.dumps(r), flush=True)
        return
    t_start = time.perf_counter()
    disk_dir = tempfile.mkdtemp(prefix="jaxkv-kv-tiers-")
    rows = []
    try:
        for mode in ("device", "host", "disk", "restart"):
            cmd = [sys.executable, __file__, "--child", mode, "--disk-dir", disk_dir,
                   "--seed", str(args.seed)] + (["--quick"] if args.quick else [])
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            line = next((x for x in out.stdout.splitlines() if x.startswith("TIER_ROW ")), None)
            if line is None:
                raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(line[len("TIER_ROW "):]))
            print(f"{mode}: {rows[-1]['computed_tokens']} prompt tokens computed, TTFT p50 "
                  f"{rows[-1]['ttft_p50_s']:.3f} s", flush=True)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    dev, host, disk, restart = rows
    ref = dev["answers"]
    answers_equal = {r["mode"]: r.pop("answers") == ref for r in rows}
    for r in rows:
        r["computed_vs_device"] = r["computed_tokens"] / dev["computed_tokens"]
        r["ttft_p50_vs_device"] = r["ttft_p50_s"] / dev["ttft_p50_s"]
        r["answers_as_device_only"] = answers_equal[r["mode"]] if r["mode"] != "restart" else None
    print_table(rows, ["mode", "computed_tokens", "computed_vs_device", "ttft_p50_s", "ttft_p99_s",
                       "ttft_p50_vs_device", "total_s", "first_turn_computed_frac", "host_hit_tokens",
                       "disk_hit_tokens", "answers_as_device_only"], floatfmt="{:.3f}")
    data = {"computed_tokens_device_only": dev["computed_tokens"],
            "computed_tokens_with_host": host["computed_tokens"],
            "computed_tokens_with_disk": disk["computed_tokens"],
            "ttft_p50_device_only_s": dev["ttft_p50_s"], "ttft_p50_with_host_s": host["ttft_p50_s"],
            "ttft_p50_with_disk_s": disk["ttft_p50_s"],
            "computed_fraction_with_host": host["computed_tokens"] / dev["computed_tokens"],
            "ttft_p50_ratio_with_host": host["ttft_p50_s"] / dev["ttft_p50_s"],
            "restart_first_turn_computed_frac": restart["first_turn_computed_frac"],
            # Every run computes the first turns in full (nothing is cached yet): the part of
            # the workload a tier can save is the later turns.
            "computed_after_first_turn_device_only": dev.get("computed_after_first_turn"),
            "computed_after_first_turn_with_host": host.get("computed_after_first_turn"),
            "conversations": convs, "turns": turns, "document_tokens": doc_len, "rows": rows,
            "seconds": time.perf_counter() - t_start}
    save("kv_tiers", data, args, fig=plot(rows))


def plot(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["mode"] for r in rows]
    a.bar(names, [r["computed_tokens"] / 1000 for r in rows], color="#4c72b0")
    a.set_ylabel("prompt tokens computed (thousands)")
    b.bar([n + " p50" for n in names], [r["ttft_p50_s"] for r in rows], color="#55a868")
    b.bar([n + " p99" for n in names], [r["ttft_p99_s"] for r in rows], color="#c44e52")
    b.set_ylabel("TTFT (s)")
    b.tick_params(axis="x", rotation=45)
    fig.suptitle("KV cache tiers: multi-turn conversations, round-robin (restart: first turns)")
    return fig


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
