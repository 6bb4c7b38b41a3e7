"""Mixtures of experts: decode speed of MoE models against dense models of the same active
parameters, side by side in one run.

  python benchmarks/moe.py            # the CPU: Mixtral- and Qwen3-MoE-shaped, small widths
  python benchmarks/moe.py --quick    # fewer repetitions

Each model is an engine of random float32 weights (load_format="dummy") whose device-only
decode step is timed (runner.forward on B sequences of 128 tokens of context; median of
--reps calls after a warmup), tokens/s = B / step seconds, at batch 1, 16 and 64. Beside each
MoE model runs a dense Llama whose MLP has the intermediate size of the experts a token runs
through (top-k x the expert's), so both do the same matmul FLOPs per token: the difference
is what routing, sorting and the grouped matmuls (jax.lax.ragged_dot) cost, and, at small
batch, the reading of every expert a step touches.
"""

from __future__ import annotations

import time

from benchmarks.common import base_parser, decode_step_ms, model_folder, print_table, save

BASE = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
            tie_word_embeddings=True)
MODELS = {  # name -> (config, the dense model of the same active MLP)
    "mixtral-shaped (8 experts, top 2)": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=512,
        num_local_experts=8, num_experts_per_tok=2),
    "qwen3-moe-shaped (64 experts, top 8)": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=1024,
        moe_intermediate_size=128, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
        head_dim=64),
}
CONTEXT, BATCHES = 128, (1, 16, 64)


def dense_twin(cfg: dict) -> dict:
    """A dense Llama whose MLP is as wide as the experts one token runs through."""
    per = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                intermediate_size=per * cfg["num_experts_per_tok"], head_dim=cfg.get("head_dim", 64))


def rows_of(name: str, config: dict, reps: int, seed: int) -> list:
    from jaxkv import LLM
    top = max(BATCHES)
    llm = LLM(model=model_folder(config), load_format="dummy", dtype="float32",
              max_model_len=CONTEXT + 16, max_num_seqs=top, max_num_batched_tokens=top,
              token_buckets=BATCHES, num_gpu_blocks_override=top * CONTEXT // 16 + 2,
              enable_prefix_caching=False, seed=seed)
    mc = llm.llm_engine.config.model_config
    rows = [{"model": name, "params_m": mc.num_params() / 1e6,
             "active_m": mc.num_params(active=True) / 1e6, "batch": b,
             "step_ms": decode_step_ms(llm, b, CONTEXT, reps, seed)} for b in BATCHES]
    llm.llm_engine.shutdown()
    for r in rows:
        r["tok_per_s"] = r["batch"] / r["step_ms"] * 1e3
    return rows


def main():
    p = base_parser("Decode speed of MoE models against dense models of the same active params",
                    "5 repetitions per step instead of 20")
    args = p.parse_args()
    reps, t0, rows = (5 if args.quick else 20), time.perf_counter(), []
    for name, extra in MODELS.items():
        moe = rows_of(name, dict(BASE, **extra), reps, args.seed)
        dense = rows_of(f"dense twin of {name.split(' ')[0]}", dense_twin(extra), reps, args.seed)
        for m, d in zip(moe, dense):
            m["vs_dense_twin"] = m["step_ms"] / d["step_ms"]
        rows += moe + dense
        print(f"{name}: {[round(r['step_ms'], 2) for r in moe]} ms; dense twin "
              f"{[round(r['step_ms'], 2) for r in dense]} ms", flush=True)
    print_table(rows, ["model", "params_m", "active_m", "batch", "step_ms", "tok_per_s", "vs_dense_twin"])
    save("moe", {"rows": rows, "context": CONTEXT, "reps": reps, "seconds": time.perf_counter() - t0}, args)


if __name__ == "__main__":
    main()
