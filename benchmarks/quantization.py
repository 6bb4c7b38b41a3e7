"""Quantized weights: bytes and decode speed of each weight format, side by side in one run.

  python benchmarks/quantization.py            # the CPU: tiny and SmolLM2-sized shapes
  python benchmarks/quantization.py --quick    # fewer repetitions
  python benchmarks/quantization.py --gpu      # a GPU: Llama-3-8B shapes at batch 1 and 128

Each (shape, format) is an engine of random weights (load_format="dummy", quantized leaves
drawn in their own format) whose device-only decode step is timed: runner.forward on a
decode SchedulerOutput of B sequences with 128 tokens of context each (median of --reps
calls after a warmup), tokens/s = B / step seconds. Formats: the float dtype (float32 on the
CPU; bfloat16 too, and alone on the GPU), fp8 (weights float8 with per-channel scales: W8A8 on
a GPU, widened in the matmul elsewhere) and int4 (AWQ's layout, groups of 64 on the CPU since
SmolLM2's 576 inputs are not a multiple of 128, 128 on the GPU). On the CPU the embedded
SmolLM2 GGUF also runs end to end, float against --quantization gguf (its own Q4_1 / Q8_0
blocks): one request's 64 greedy tokens through LLM.generate (single-stream decode tok/s).
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.common import base_parser, decode_step_ms, model_folder, print_table, save

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192, hidden_size=256,
            intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True)
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                 hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
CONTEXT = 128


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}


def step_rows(shape: str, config: dict, fmt: str, dtype: str, batches, reps: int, seed: int) -> list:
    """Device-only decode steps of the engine of `config` in format `fmt` at each batch size."""
    from jaxkv import LLM
    qc = {"int4": awq_config(64 if config["hidden_size"] % 128 else 128)}.get(fmt)
    model = model_folder({**config, **({"quantization_config": qc} if qc else {})})
    top = max(batches)
    llm = LLM(model=model, load_format="dummy", dtype=dtype, quantization="fp8" if fmt == "fp8" else None,
              max_model_len=CONTEXT + 16, max_num_seqs=top, max_num_batched_tokens=top,
              token_buckets=tuple(sorted(set(batches))), num_gpu_blocks_override=top * CONTEXT // 16 + 2,
              enable_prefix_caching=False, seed=seed)
    s = llm.stats()
    rows = []
    for b in batches:
        ms = decode_step_ms(llm, b, CONTEXT, reps, seed)
        rows.append({"shape": shape, "format": fmt, "dtype": dtype, "weights_mib": s.weights_bytes / 2**20,
                     "batch": b, "step_ms": ms, "tok_per_s": b / ms * 1e3})
    llm.llm_engine.shutdown()
    return rows


def end_to_end(quantization, seed: int) -> dict:
    """The embedded SmolLM2: one request's 64 greedy tokens, after an untimed warmup request."""
    from jaxkv import LLM, SamplingParams
    llm = LLM(quantization=quantization, max_model_len=512, seed=seed)
    llm.llm_engine.wait_for_background_compile()
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = [{"prompt_token_ids": np.random.default_rng(seed).integers(100, 40000, 32).tolist()}]
    llm.generate(prompt, sp, use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    wall = time.perf_counter() - t0
    s = llm.stats()
    return {"model": "SmolLM2-135M GGUF", "quantization": quantization or "none (float32)",
            "weights_mib": s.weights_bytes / 2**20, "single_stream_tok_per_s": len(out.token_ids) / wall,
            "token_ids": list(out.token_ids)}


def main():
    p = base_parser("Bytes and decode speed of each weight format, side by side",
                    "5 repetitions per step instead of 20")
    p.add_argument("--gpu", action="store_true", help="Llama-3-8B shapes, bfloat16 / fp8 / int4, "
                   "batch 1 and 128 (needs a GPU with ~60 GB free)")
    args = p.parse_args()
    reps, t0 = (5 if args.quick else 20), time.perf_counter()
    if args.gpu:
        plan = [("llama3-8b", LLAMA3_8B, f, "bfloat16", (1, 128)) for f in ("float", "fp8", "int4")]
    else:
        from jaxkv.loader.source import read_config
        smol = {k: v for k, v in read_config(None).items() if k != "quantization_config"}
        plan = [(name, cfg, f, dt, (1, 32)) for name, cfg in (("tiny", TINY), ("smollm2", smol))
                for f, dt in (("float", "float32"), ("float", "bfloat16"), ("fp8", "float32"),
                              ("int4", "float32"))]
    rows = []
    for shape, cfg, fmt, dtype, batches in plan:
        rows += step_rows(shape, cfg, fmt, dtype, batches, reps, args.seed)
        print(f"{shape} {fmt} {dtype}: {[round(r['step_ms'], 2) for r in rows[-len(batches):]]} ms", flush=True)
    for r in rows:  # against the first format of the same shape and batch (float32 / bfloat16)
        base = next(x for x in rows if x["shape"] == r["shape"] and x["batch"] == r["batch"])
        r["step_vs_float"] = r["step_ms"] / base["step_ms"]
    print_table(rows, ["shape", "format", "dtype", "weights_mib", "batch", "step_ms", "tok_per_s",
                       "step_vs_float"])
    e2e = [] if args.gpu else [end_to_end(q, args.seed) for q in (None, "gguf")]
    if e2e:
        same = e2e[0]["token_ids"] == e2e[1]["token_ids"]
        for r in e2e:
            r.pop("token_ids")
        print_table(e2e)
        print(f"gguf blocks kept: the same 64 greedy tokens as the float path: {same}")
    data = {"rows": rows, "end_to_end": e2e, "context": CONTEXT, "reps": reps,
            "seconds": time.perf_counter() - t0}
    save("quantization" + ("-gpu" if args.gpu else ""), data, args)


if __name__ == "__main__":
    main()
