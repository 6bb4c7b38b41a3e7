"""This machine's rooflines, measured in the run that uses them, and the FLOP model of a workload.

Probes (jitted, median of `reps` calls after a warmup):
  memory_gbps     a sum over 256 MiB of float32: the read bandwidth a weight read can reach;
  matmul_gflops   8 independent [rows, hidden] x [hidden, intermediate] products in one
                  program: the GEMM throughput at a step's shape (rows = the step's token
                  rows) with every core busy (one product alone runs on one core or on
                  both, from call to call).
FLOP model of a Llama-family decoder (float32, multiply-add = 2 FLOPs), per token computed:
  2 x (the weight matrices' parameters: q, k, v, o, gate, up, down of every layer)
  + 4 x context x num_heads x head_dim x num_layers (QK^T and PV over the token's context)
  + 2 x hidden_size x vocab_size when the token's row is sampled (the logits).
For the embedded SmolLM2-135M that is 0.21 GFLOP per prefill token (2 x 106.2 M linear parameters) and 0.29 per decoded token
at a 256-token context (0.212 + 0.018 attention + 0.057 logits).

Decode attention is a read of K/V, not a GEMM: each decoded token reads its whole context's K
and V rows in every layer (SmolLM2, float32 pool: 46,080 bytes a context token; ~84 GB over
throughput.py's full workload against ~2 TFLOP of decode matmuls). The FLOP model above prices
it at 4 x context x heads x head_dim FLOPs; `decode_kv_bytes` gives the bytes, which the
throughput benchmark prices at the memory probe's bandwidth beside the compute roofline.

The workload roofline prices prefill tokens at the GEMM throughput of a full prefill step
(`prefill_rows`, the token budget) and decoded tokens at that of a decode step
(`decode_rows`, the running sequences), which is the best this machine's GEMMs do at those
shapes; `roofline_tok_s` = output tokens / that time.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a script or a module
from common import timed  # noqa: E402


def memory_gbps(reps: int = 10) -> float:
    """Read bandwidth in GB/s: a jitted sum over 256 MiB of float32."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((64 << 20,), jnp.float32)
    return x.nbytes / timed(jax.jit(lambda a: a.sum()), x, iters=reps)[1] / 1e9


def matmul_gflops(rows: int, hidden: int, inter: int, reps: int = 10, products: int = 8) -> float:
    """GFLOP/s of float32 [rows, hidden] x [hidden, inter] products: one jitted program of
    `products` independent ones (distinct weights, results summed), which XLA:CPU runs side by
    side on every core. One product alone is not the machine's throughput: XLA runs a
    64-row product on one core or on both, from call to call (its median over 10 calls read
    114-197 GFLOP/s on the 2-core Xeon, where 8 products read 235-250)."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((rows, hidden), jnp.float32)
    bs = [jnp.full((hidden, inter), 1.0 / (i + 1), jnp.float32) for i in range(products)]
    f = jax.jit(lambda a, bs: sum((a @ b).sum() for b in bs))
    return products * 2 * rows * hidden * inter / timed(f, a, bs, iters=reps)[1] / 1e9


def linear_params(cfg) -> int:
    """Parameters of one token's weight matmuls (all layers; embedding and logits excluded)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)


def weight_bytes(params) -> int:
    """Bytes of a pytree of weight arrays: what one single-stream decode step reads."""
    import jax
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def tokens_flops(cfg, contexts, sampled: int) -> float:
    """FLOPs of computing tokens at these contexts (each its own context, itself included),
    `sampled` of them with logits."""
    contexts = np.asarray(contexts, np.float64)
    attn = 4 * contexts.sum() * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 2 * linear_params(cfg) * contexts.size + attn + sampled * 2 * cfg.hidden_size * cfg.vocab_size


def workload_flops(cfg, prompt_lens, new_tokens: int) -> tuple[float, float]:
    """(prefill FLOPs, decode FLOPs) of prompts of these lengths, each generating new_tokens:
    every prompt token once (the last one sampled), then new_tokens - 1 decoded tokens, each
    sampled."""
    pre = sum(tokens_flops(cfg, np.arange(1, p + 1), 1) for p in prompt_lens)
    dec = sum(tokens_flops(cfg, np.arange(p + 1, p + new_tokens), new_tokens - 1)
              for p in prompt_lens)
    return pre, dec


def decode_kv_bytes(cfg, prompt_lens, new_tokens: int, itemsize: int) -> float:
    """Bytes of K and V that decode attention reads over the workload: each of a prompt's
    new_tokens - 1 decoded tokens reads its context (itself included, as workload_flops
    counts it) in every layer, 2 x num_kv_heads x head_dim elements of `itemsize` bytes per
    context token and layer. Prefill chunks (each context row read once per chunk) are not
    counted."""
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize * cfg.num_layers
    ctx = sum(float(np.arange(p + 1, p + new_tokens).sum()) for p in prompt_lens)
    return ctx * per_token


def workload_roofline(cfg, prompt_lens, new_tokens: int, *, decode_rows: int, prefill_rows: int,
                      reps: int = 10) -> dict:
    """The workload's compute roofline measured now: GFLOP/s probes at the decode and prefill
    step shapes, the workload's FLOPs, and roofline_s / roofline_tok_s."""
    pre, dec = workload_flops(cfg, prompt_lens, new_tokens)
    g_dec = matmul_gflops(decode_rows, cfg.hidden_size, cfg.intermediate_size, reps)
    g_pre = matmul_gflops(prefill_rows, cfg.hidden_size, cfg.intermediate_size, reps)
    secs = pre / g_pre / 1e9 + dec / g_dec / 1e9
    return {"workload_gflop": (pre + dec) / 1e9, "decode_GFLOPs": g_dec, "prefill_GFLOPs": g_pre,
            "roofline_s": secs, "roofline_tok_s": len(prompt_lens) * new_tokens / secs}
