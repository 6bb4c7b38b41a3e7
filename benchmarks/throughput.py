"""Offline throughput: jaxkv against Hugging Face transformers (PyTorch CPU) on the same GGUF.

Workload (fixed by --seed): 64 prompts of random ordinary token ids, lengths uniform in
64-256, 128 new tokens each, greedy, EOS ignored (--quick: 16 prompts, 32 new tokens). What is
measured, each as output tokens / wall time of the measured calls, after an untimed warmup:

- jaxkv: all prompts in ONE `LLM.generate` call (paged KV cache, continuous batching, default
  engine arguments), and single-stream decode: one ~40-token chat prompt alone, 128 new tokens.
- HF sequential: transformers' `model.generate` one request at a time with its KV cache
  (greedy, min_new_tokens = max_new_tokens forces the length), on the first
  --hf-sequential-prompts prompts of the same workload (default 16, --quick 8: one request at
  a time runs at ~27-30 tokens/s, so all 64 would take ~5 minutes; tokens/s stays comparable).
- HF batched: static batches of 8 in workload order, left-padded with an attention mask; each
  batch runs until its 8 x max_new_tokens are done.
- llama.cpp (--with-llama-cpp, only when llama-cpp-python is importable; else null): the same
  GGUF (Q4_1, as shipped), one request at a time on the same subset as HF sequential.

- Rooflines, measured in the same run after jaxkv's (benchmarks/roofline.py): the workload's
  FLOPs over this machine's GEMM throughput at the decode and prefill step shapes
  (`roofline_tok_s`; `roofline_fraction` = jaxkv tokens/s over it), and the single-stream
  weight-read roofline, the memory probe's bandwidth over the weights' bytes
  (`single_stream_roofline_tok_s`, `single_stream_roofline_fraction`). Beside them, what the
  compute roofline leaves out: the K/V bytes decode attention reads (`decode_kv_read_gb`), at
  the memory probe's bandwidth (`decode_kv_read_s`), and the compute roofline with that time
  added (`roofline_with_kv_tok_s`, `roofline_with_kv_fraction`): within a layer the attention
  waits for q and the next matmul for its output, so the two add up. Information, not a target.
- --kv-cache-dtype (vLLM's flag; default auto, the weights' float32) runs jaxkv with a narrower
  KV pool: fewer bytes for decode attention to read, outputs no longer those of the float32
  model (see benchmarks/kv_cache_dtype.py). The targets are for the default.

The HF model is the same GGUF dequantized to float32 by transformers; torch uses all cores.
Targets (speed issue): roofline_fraction >= 0.7, jaxkv >= 3x HF static batches of 8,
single_stream_roofline_fraction >= 0.8; and (benchmarks issue) >= 20x HF sequential. Full mode
takes about 6-7 minutes on 2 quiet CPU cores (HF alone ~4), --quick
about 1.5 minutes.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import base_parser, print_table, random_prompts, save
from roofline import decode_kv_bytes, memory_gbps, weight_bytes, workload_roofline

SINGLE_PROMPT = ("Explain in a few sentences why a key-value cache makes generating text with a "
                 "transformer faster.")
EOS = 2  # SmolLM2's <|im_end|>, also its pad token


def run_jaxkv(prompts, new_tokens, kv_cache_dtype="auto"):
    from jaxkv import LLM, SamplingParams

    llm = LLM(kv_cache_dtype=kv_cache_dtype)

    llm.llm_engine.wait_for_background_compile()  # time the steady state
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], warm, use_tqdm=False)  # untimed
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    after = llm.stats()
    single = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    conv = [{"role": "user", "content": SINGLE_PROMPT}]
    llm.chat(conv, single, use_tqdm=False)  # warmup
    t0 = time.perf_counter()
    out = llm.chat(conv, single, use_tqdm=False)[0]
    dt1 = time.perf_counter() - t0
    # This machine's rooflines, measured now, next to what they bound (benchmarks/roofline.py).
    runner, cfg = llm.llm_engine.runner, llm.llm_engine.runner.model.cfg
    roof = workload_roofline(cfg, [len(p) for p in prompts], new_tokens,
                             decode_rows=min(len(prompts), runner.max_num_seqs),
                             prefill_rows=runner.token_buckets[-1])
    gbs = memory_gbps()
    single_roof = gbs * 1e9 / weight_bytes(runner.params)  # one weight read a token
    kv = decode_kv_bytes(cfg, [len(p) for p in prompts], new_tokens,
                         np.dtype(runner.kv_cache.k.dtype).itemsize)
    with_kv = roof["roofline_s"] + kv / gbs / 1e9
    res = {"jaxkv_tok_s": n / dt, "jaxkv_s": dt, "jaxkv_tokens": n, **roof,
           "roofline_fraction": n / dt / roof["roofline_tok_s"],
           "memory_GBps": gbs, "kv_cache_dtype": llm.llm_engine.config.runner.kv_cache_dtype,
           "decode_kv_read_gb": kv / 1e9, "decode_kv_read_s": kv / gbs / 1e9,
           "roofline_with_kv_tok_s": n / with_kv,
           "roofline_with_kv_fraction": with_kv / dt,
           "single_stream_roofline_tok_s": single_roof,
           "single_stream_roofline_fraction": len(out.outputs[0].token_ids) / dt1 / single_roof,
           "jaxkv_single_stream_tok_s": len(out.outputs[0].token_ids) / dt1,
           "single_stream_prompt_tokens": len(out.prompt_token_ids),
           "jaxkv_preemptions": after.num_preemptions - before.num_preemptions}
    del llm, outs
    gc.collect()
    return res


def load_hf():
    import torch
    from transformers import AutoModelForCausalLM

    from jaxkv.loader.gguf import embedded_model_path

    torch.set_num_threads(os.cpu_count())
    folder, name = os.path.split(embedded_model_path())
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def hf_generate(model, batch, new_tokens):
    """Greedy generate for a list of prompts (left-padded); returns the new tokens produced."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.tensor([[EOS] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=EOS)
    return (out.shape[1] - width) * len(batch)


def run_hf(prompts, new_tokens, n_seq):
    model = load_hf()
    hf_generate(model, [prompts[0][:16]], 4)                        # warmups, untimed
    hf_generate(model, [p[:16] for p in prompts[:8]], 4)
    t0, n = time.perf_counter(), 0
    for p in prompts[:n_seq]:
        n += hf_generate(model, [p], new_tokens)
    seq = n / (time.perf_counter() - t0)
    t0, n = time.perf_counter(), 0
    for i in range(0, len(prompts), 8):
        n += hf_generate(model, prompts[i:i + 8], new_tokens)
    batched = n / (time.perf_counter() - t0)
    del model
    gc.collect()
    return seq, batched


def run_llama_cpp(prompts, new_tokens, n_seq):
    """llama-cpp-python on the same GGUF, one request at a time, in a fresh process (loaded
    into a process that already holds torch, its build here died with SIGILL); None when it
    is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    ctx = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            return pool.submit(_llama_cpp_worker, prompts, new_tokens, n_seq).result()
    except Exception as e:  # a crashed worker (BrokenProcessPool) must not lose jaxkv's numbers
        print(f"llama-cpp-python failed: {type(e).__name__}: {e}")
        return None


def _llama_cpp_worker(prompts, new_tokens, n_seq):
    from llama_cpp import Llama

    from jaxkv.loader.gguf import embedded_model_path

    llm = Llama(model_path=embedded_model_path(), n_ctx=512, n_batch=512, n_threads=os.cpu_count(),
                verbose=False)
    kw = {"max_tokens": new_tokens, "temperature": 0.0, "logit_bias": {EOS: -1e9}}
    llm.create_completion(prompt=prompts[0][:16], **{**kw, "max_tokens": 4})  # warmup
    t0, n = time.perf_counter(), 0
    for p in prompts[:n_seq]:
        llm.reset()
        n += llm.create_completion(prompt=p, **kw)["usage"]["completion_tokens"]
    return n / (time.perf_counter() - t0)


def main():
    ap = base_parser(__doc__,
                     "16 prompts x 32 new tokens, HF sequential on 8 of them (about 1.5 minutes)")
    ap.add_argument("--hf-sequential-prompts", type=int, default=None,
                    help="prompts HF runs one at a time (default 16, --quick 8)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="jaxkv's KV pool dtype (vLLM's flag; auto: the weights' float32)")
    ap.add_argument("--with-llama-cpp", action="store_true",
                    help="also time llama-cpp-python (only when it is installed)")
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    args = ap.parse_args()
    num, new_tokens = (16, 32) if args.quick else (64, 128)
    n_seq = args.hf_sequential_prompts or (8 if args.quick else 16)
    n_seq = min(n_seq, num)
    prompts = random_prompts(np.random.default_rng(args.seed), num, 64, 256)
    print(f"workload: {num} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} random tokens, "
          f"{new_tokens} new tokens each, greedy, EOS ignored; HF sequential on the first {n_seq}")

    t_start = time.perf_counter()
    r = run_jaxkv(prompts, new_tokens, args.kv_cache_dtype)
    print(f"jaxkv: {r['jaxkv_tokens']} tokens in {r['jaxkv_s']:.1f} s; single stream "
          f"{r['jaxkv_single_stream_tok_s']:.1f} tokens/s ({r['single_stream_prompt_tokens']}-token prompt)")
    hf_seq, hf_bat = run_hf(prompts, new_tokens, n_seq)
    llama = run_llama_cpp(prompts, new_tokens, n_seq) if args.with_llama_cpp else None
    if args.with_llama_cpp and llama is None:
        print("llama-cpp-python is not installed or failed: llama_cpp_tok_s is null")

    data = {"jaxkv_tok_s": r["jaxkv_tok_s"], "jaxkv_single_stream_tok_s": r["jaxkv_single_stream_tok_s"],
            "hf_sequential_tok_s": hf_seq, "hf_batched_tok_s": hf_bat, "llama_cpp_tok_s": llama,
            "hf_sequential_prompts": n_seq, "num_prompts": num, "new_tokens": new_tokens,
            "single_stream_prompt_tokens": r["single_stream_prompt_tokens"],
            "jaxkv_preemptions": r["jaxkv_preemptions"],
            "speedup_vs_hf_sequential": r["jaxkv_tok_s"] / hf_seq,
            "speedup_vs_hf_batched": r["jaxkv_tok_s"] / hf_bat,
            **{k: r[k] for k in ("roofline_tok_s", "roofline_fraction", "roofline_s",
                                 "workload_gflop", "decode_GFLOPs", "prefill_GFLOPs",
                                 "memory_GBps", "kv_cache_dtype", "decode_kv_read_gb",
                                 "decode_kv_read_s", "roofline_with_kv_tok_s",
                                 "roofline_with_kv_fraction",
                                 "single_stream_roofline_tok_s",
                                 "single_stream_roofline_fraction")}}
    rows = [{"system": "jaxkv (one generate call)", "prompts": num, "tokens/s": data["jaxkv_tok_s"],
             "jaxkv speedup": 1.0},
            {"system": "jaxkv single stream", "prompts": 1, "tokens/s": data["jaxkv_single_stream_tok_s"],
             "jaxkv speedup": None},
            {"system": "compute roofline (this machine's GEMMs)", "prompts": num,
             "tokens/s": data["roofline_tok_s"], "jaxkv speedup": data["roofline_fraction"]},
            {"system": "compute roofline + decode K/V reads (memory probe)", "prompts": num,
             "tokens/s": data["roofline_with_kv_tok_s"],
             "jaxkv speedup": data["roofline_with_kv_fraction"]},
            {"system": "single-stream roofline (one weight read per token)", "prompts": 1,
             "tokens/s": data["single_stream_roofline_tok_s"],
             "jaxkv speedup": data["single_stream_roofline_fraction"]},
            {"system": "HF one at a time", "prompts": n_seq, "tokens/s": hf_seq,
             "jaxkv speedup": data["speedup_vs_hf_sequential"]},
            {"system": "HF static batches of 8", "prompts": num, "tokens/s": hf_bat,
             "jaxkv speedup": data["speedup_vs_hf_batched"]}]
    if llama is not None:
        rows.append({"system": "llama-cpp-python (Q4_1)", "prompts": n_seq, "tokens/s": llama,
                     "jaxkv speedup": r["jaxkv_tok_s"] / llama})
    print()
    print_table(rows, floatfmt="{:.1f}")
    for what, got, want in [("jaxkv / HF sequential", data["speedup_vs_hf_sequential"], 20),
                            ("jaxkv / HF batched", data["speedup_vs_hf_batched"], 3),
                            ("roofline_fraction", data["roofline_fraction"], 0.7),
                            ("single_stream_roofline_fraction",
                             data["single_stream_roofline_fraction"], 0.8)]:
        verdict = "met" if got >= want else f"SHORT by {100 * (1 - got / want):.0f}%"
        print(f"target {what} >= {want}: {got:.2f} ({verdict})")
    if args.quick:
        print("(--quick: short outputs weigh prefill more; the targets are for the full workload)")
    print(f"total run time {time.perf_counter() - t_start:.0f} s")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [x["system"] for x in rows]
    vals = [x["tokens/s"] for x in rows]
    bars = ax.barh(names[::-1], vals[::-1], color=["#888"] * (len(rows) - 2) + ["#e8a33d", "#3b75af"])
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set_xlabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M fp32 on CPU: {num} prompts (64-256 tok) x {new_tokens} new tokens")
    ax.set_xlim(0, max(vals) * 1.18)
    save("throughput", data, args, fig)


if __name__ == "__main__":
    main()
