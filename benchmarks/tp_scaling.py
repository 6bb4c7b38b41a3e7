"""Tensor parallelism: what splitting the step over N devices costs (or buys) per decode step.

For TP = 1, 2, 4 (default; --tp), one process each with N forced host devices on a CPU
(XLA_FLAGS=--xla_force_host_platform_device_count=N; on a GPU machine, its real devices):
the embedded SmolLM2-135M-Instruct (float32; 9 query / 3 KV heads, so TP 2 and 4 cannot split
it: a random-weight model of the same size with 8 / 4 heads is used for every N, --model
smollm2 keeps the embedded one with TP 1 and 3), a 64-sequence decode step (64 prompts of 64
tokens, 64 greedy tokens each) timed after warmup, and the output tokens/s of the generate
call. One more row (unless --processes 1) runs the largest TP over 2 processes
(jax.distributed with gloo collectives, N/2 forced devices each, process 0 timed): what the
step's broadcast to the other process and the collectives between processes add. On a 2-core
CPU the forced devices share the same two cores, so no speed-up is expected: the point is the
overhead of the partitioned program and its collectives, reported as measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from common import base_parser, print_table, save

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
             hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


def child(tp: int, model: str, num: int, new_tokens: int, dist: dict) -> dict:
    """Runs in a process with `tp` devices (or its share of them, with `dist`: the
    num_processes / process_id / distributed_coordinator of a multi-process engine; only
    process 0 returns): one engine, timed decode."""
    import numpy as np

    from jaxkv import LLM, SamplingParams
    kw = dict(tensor_parallel_size=tp, max_model_len=512, kv_cache_memory_bytes=1 << 30,
              token_buckets=(1, 8, 64, 512), **dist)  # all compiled at warmup
    if model == "llama8":
        from jaxkv.loader.gguf import embedded_model_path
        from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(LLAMA, f)
        tokenizer_from_gguf(embedded_model_path()).save_pretrained(d)
        kw.update(model=d, load_format="dummy")
    llm = LLM(**kw)
    llm.llm_engine.wait_for_background_compile()
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 49152, 64).tolist()} for _ in range(num)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    eng, times = llm.llm_engine, []
    step = eng.step

    def timed_step():
        t0 = time.perf_counter()
        out = step()
        if len(eng.scheduler.running) == num and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running):
            times.append(time.perf_counter() - t0)
        return out
    eng.step = timed_step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    from jaxkv.models.sharding import bytes_per_device
    r = eng.runner
    return {"tp": tp, "processes": dist.get("num_processes", 1), "decode_step_ms": 1e3 * float(np.median(times)), "decode_steps": len(times),
            "tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "param_mib_per_device": max(bytes_per_device(r.params)) / 2**20,
            "kv_blocks": r.num_blocks, "first_tokens": outs[0].outputs[0].token_ids[:8]}


def main():
    p = base_parser("Decode step time and tok/s at tensor_parallel_size 1/2/4",
                    "16 sequences of 16 new tokens")
    p.add_argument("--tp", default="1,2,4", help="sizes to run (default 1,2,4)")
    p.add_argument("--model", default="llama8", choices=("llama8", "smollm2"),
                   help="llama8: random weights, SmolLM2's size with 8/4 heads (default); "
                   "smollm2: the embedded model (9/3 heads: TP 1 and 3)")
    p.add_argument("--processes", type=int, default=2, choices=(1, 2),
                   help="2 (default): one more row, the largest TP over 2 processes; 1: none")
    p.add_argument("--child", type=int, default=None, help=argparse_hidden())
    p.add_argument("--dist", default=None, help=argparse_hidden())  # JSON: process id, port
    args = p.parse_args()
    num, new = (16, 16) if args.quick else (64, 64)
    if args.child is not None:
        dist = json.loads(args.dist) if args.dist else {}
        print("TP_ROW " + json.dumps(child(args.child, args.model, num, new, dist)), flush=True)
        return
    t_start = time.perf_counter()
    rows = []
    sizes = [int(x) for x in args.tp.split(",")]
    runs = [(tp, 1) for tp in sizes] + ([(max(sizes), 2)] if args.processes == 2 and max(sizes) % 2 == 0 else [])
    for tp, procs in runs:
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp // procs}"}
        cmd = [sys.executable, __file__, "--child", str(tp), "--model", args.model]
        cmd += ["--quick"] if args.quick else []
        port = free_port()
        ps = [subprocess.Popen(cmd + (["--dist", json.dumps(dict(
            num_processes=procs, process_id=i, distributed_coordinator=f"127.0.0.1:{port}"))]
            if procs > 1 else []), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in range(procs)]
        outs = [x.communicate(timeout=3600) for x in ps]
        line = next((x for x in outs[0][0].splitlines() if x.startswith("TP_ROW ")), None)
        if line is None or any(x.returncode for x in ps):
            raise SystemExit(f"TP {tp} over {procs} process(es) failed:\n"
                             + "\n".join(e[-2000:] for _, e in outs))
        rows.append(json.loads(line[7:]))
        print(f"TP {tp} ({procs} process(es)): {rows[-1]['decode_step_ms']:.1f} ms per decode step",
              flush=True)
    first = [r.pop("first_tokens") for r in rows]
    for r, toks in zip(rows, first):
        r["step_vs_tp1"] = r["decode_step_ms"] / rows[0]["decode_step_ms"]
        r["first_8_tokens_as_tp1"] = toks == first[0]
    print_table(rows, ["tp", "processes", "decode_step_ms", "step_vs_tp1", "tok_per_s", "param_mib_per_device",
                       "kv_blocks", "decode_steps", "first_8_tokens_as_tp1"], floatfmt="{:.2f}")
    save("tp_scaling", {"rows": rows, "model": args.model, "sequences": num, "new_tokens": new,
                        "seconds": time.perf_counter() - t_start}, args)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
