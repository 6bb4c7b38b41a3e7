"""Where one engine step's time goes, next to this machine's rooflines measured in the same run.

  python -m benchmarks.profile_step                      # the two reference shapes
  python -m benchmarks.profile_step --shape 16 512 1     # sequences x context x tokens each

For each shape (S sequences whose context is C tokens, Q of them computed this step) the
engine's embedded SmolLM2 (float32, default CPU engine) is given one SchedulerOutput of that
shape, and these are timed (median of --reps calls after a warmup call):
  host        runner.build_inputs: the padded StepInput on the host (Python + numpy)
  step        runner.forward: the jitted step (matmuls, K/V write, attention, norms, RoPE)
  sample      runner.execute - forward - build_inputs, fused sampling off: the
              sampled rows' logits, sampling and the transfer of the tokens back
  matmuls     every layer's 7 weight matmuls at the step's T rows (jitted alone), as the
              model runs and chains them (each layer's input is the last one's output): the
              cpu backend's C++ kernel for T <= 16, else XLA dots
  attention   one layer's attention at the step's shape (prepare once + attend), x num_layers
  gather      copying one layer's K and V blocks of the step's sequences (the floor of an
              attention that gathers before it computes, as XLA does)
  kv_write    one layer's slot-mapping K/V write, x num_layers
Rooflines, measured here (benchmarks/roofline.py): memory bandwidth (a jitted sum over 256
MiB) and matmul throughput (8 independent [T, hidden] x [hidden, intermediate] products in one
jitted program, at the step's T). matmul roofline = the step's matmul FLOPs / that throughput; attention roofline =
the K/V bytes it must read / bandwidth; a single decode's roofline = the weight bytes /
bandwidth (it is a weight read).

Output: a table per shape and ONE JSON line (benchmarks/common.save) with, at least,
decode_attention_ms_per_layer (64 x 256), decode_step_ms and decode_step_roofline_ms
(64-sequence decode: measured, and matmul + attention rooflines), single_decode_ms and
single_decode_roofline_ms.
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import base_parser, machine_info, print_table, save, timed
from benchmarks.roofline import linear_params, matmul_gflops, memory_gbps, weight_bytes

REFERENCE_SHAPES = [(64, 256, 1), (1, 256, 1)]


def median_ms(fn, reps: int) -> float:
    """Median of `reps` calls of fn() in ms, after a warmup call."""
    return timed(fn, iters=reps)[1] * 1e3


def scheduler_output(num_seqs, context, tokens, block_size, seed, temperature=0.0):
    from jaxkv import SamplingParams
    from jaxkv.core.scheduler_output import ScheduledRequest, SchedulerOutput
    rng = np.random.default_rng(seed)
    per = -(-context // block_size)
    sp = SamplingParams(temperature=temperature)
    return SchedulerOutput([
        ScheduledRequest(f"p{s}", rng.integers(100, 40000, tokens).tolist(), context - tokens,
                         list(range(1 + s * per, 1 + (s + 1) * per)), True, sp, s, 0, 0)
        for s in range(num_seqs)])


def profile(llm, shape, reps: int, seed: int, temperature: float = 0.0) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxkv.attention import write_kv
    num_seqs, context, tokens = shape
    runner = llm.llm_engine.runner
    c, p = runner.model.cfg, runner.params
    out = scheduler_output(num_seqs, context, tokens, runner.block_size, seed, temperature)
    si = runner.build_inputs(out)
    t = si.num_tokens
    row = {"shape": f"{num_seqs}x{context}x{tokens}", "bucket": t, "temperature": temperature}
    row["host_ms"] = median_ms(lambda: runner.build_inputs(out), reps)
    row["step_ms"] = median_ms(lambda: runner.forward(si), reps)
    fused, runner.fused_sampling_max_tokens = runner.fused_sampling_max_tokens, 0
    try:  # the separate sampler programs, as the column says (not fused sampling)
        execute = median_ms(lambda: runner.execute(out).sampled, reps)
    finally:
        runner.fused_sampling_max_tokens = fused
    row["sample_ms"] = max(0.0, execute - row["step_ms"] - row["host_ms"])

    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((t, c.hidden_size)), jnp.float32)

    from jaxkv.cpu_kernels import linear as cpu_linear
    from jaxkv.models.params import split_projections

    def mm_group(x, *ws):  # as the model runs them (llama.matmul): one kernel call, or dots
        if runner.model.cpu_matmul and cpu_linear.applies(x, *ws):
            return cpu_linear.matmul(x, *ws)
        return [x @ w for w in ws]

    def matmuls(params, h):  # chained as the model chains them (tanh keeps h bounded)
        acc = 0.0
        for i in range(c.num_layers):
            layer = split_projections(params[f"layers_{i}"], c)  # (fused on a GPU)
            lp = {k: v["kernel"] for k, v in layer.items() if "kernel" in v}
            q, k, v = mm_group(h, lp["q_proj"], lp["k_proj"], lp["v_proj"])
            (o,) = mm_group(q, lp["o_proj"])
            h = jnp.tanh(h + o)
            g, u = mm_group(h, lp["gate_proj"], lp["up_proj"])
            (d,) = mm_group(g * u, lp["down_proj"])
            h = jnp.tanh(h + d)
            acc = acc + k.sum() + v.sum()
        return acc + h.sum()
    mm = jax.jit(matmuls)
    row["matmuls_ms"] = median_ms(lambda: mm(p, h), reps)
    flops = 2 * t * linear_params(c)

    attn, pool = runner.model.attention, runner.kv_cache
    kc, vc = pool.k, pool.v
    q = jnp.asarray(rng.standard_normal((t, c.num_heads, c.head_dim)), jnp.float32)
    prep = jax.jit(lambda step: attn.prepare(step, runner.block_size))
    shared = prep(si)
    one = jax.jit(lambda q, pool, step, shared: attn.attend(q, pool, step, shared, layer=0,
                                                            scale=c.head_dim ** -0.5))
    row["attention_ms_per_layer"] = median_ms(lambda: one(q, pool, si, shared), reps)
    row["attention_prepare_ms"] = median_ms(lambda: prep(si), reps)
    row["attention_ms"] = row["attention_ms_per_layer"] * c.num_layers + row["attention_prepare_ms"]
    # The floor of any attention that gathers the context before computing on it (XLA cannot
    # fuse a gather into a dot): copying one layer's K and V blocks of the step.
    used = -(-int(si.seq_lens.max()) // runner.block_size)
    tables = jnp.asarray(si.block_tables[:num_seqs, :used])
    gather = jax.jit(lambda kc, vc, b: (kc[0, b], vc[0, b]))
    row["attention_gather_ms_per_layer"] = median_ms(lambda: gather(kc, vc, tables), reps)
    kv = jnp.asarray(rng.standard_normal((t, c.num_kv_heads, c.head_dim)), jnp.float32)
    write = jax.jit(lambda pool, k, v, s: write_kv(pool, k, v, s, 0), donate_argnums=(0,))
    state = {"kv": pool}

    def write_once():
        state["kv"] = write(state["kv"], kv, kv, si.slot_mapping)
        return state["kv"]
    row["kv_write_ms"] = median_ms(write_once, reps) * c.num_layers
    runner.kv_cache = state["kv"]

    gbs, gflops = memory_gbps(reps), matmul_gflops(t, c.hidden_size, c.intermediate_size, reps)
    kv_bytes = int(si.seq_lens.sum()) * 2 * c.num_kv_heads * c.head_dim * 4  # per layer, float32
    row.update(memory_GBps=gbs, matmul_GFLOPs=gflops,
               matmul_roofline_ms=flops / gflops / 1e6,
               attention_roofline_ms_per_layer=kv_bytes / gbs / 1e6,
               weight_read_roofline_ms=weight_bytes(p) / gbs / 1e6)
    row["step_roofline_ms"] = (row["matmul_roofline_ms"]
                               + row["attention_roofline_ms_per_layer"] * c.num_layers)
    return row


def main():
    p = base_parser("One engine step split into host, matmuls, attention, K/V write and sampling, "
                    "next to this machine's rooflines", "fewer repetitions (5)")
    p.add_argument("--shape", type=int, nargs=3, action="append", metavar=("SEQS", "CONTEXT", "TOKENS"),
                   help="sequences x context x tokens computed per sequence (repeatable; "
                        "default: 64 256 1 and 1 256 1)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="the pool's dtype (jaxkv's --kv-cache-dtype; default auto = float32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every row (default 0: greedy; > 0 times the "
                        "random sampler, whose per-row noise is the exponential race)")
    args = p.parse_args()
    reps = 5 if args.quick else args.reps
    from jaxkv import LLM
    llm = LLM(kv_cache_dtype=args.kv_cache_dtype)
    llm.llm_engine.wait_for_background_compile()  # time the steady state
    rows = [profile(llm, tuple(s), reps, args.seed, args.temperature)
            for s in (args.shape or REFERENCE_SHAPES)]
    print(f"machine: {machine_info()}")
    print_table(rows, ["shape", "bucket", "step_ms", "step_roofline_ms", "host_ms", "sample_ms",
                       "matmuls_ms", "matmul_roofline_ms", "attention_ms", "attention_ms_per_layer",
                       "attention_roofline_ms_per_layer", "attention_gather_ms_per_layer", "kv_write_ms"])
    data = {"rows": rows}
    by = {r["shape"]: r for r in rows}
    if args.temperature > 0:  # the reference keys are the greedy profile's
        save("profile_step-random", data, args)
        return
    if "64x256x1" in by:
        d = by["64x256x1"]
        data.update(decode_attention_ms_per_layer=d["attention_ms_per_layer"],
                    decode_step_ms=d["step_ms"], decode_step_roofline_ms=d["step_roofline_ms"])
    if "1x256x1" in by:
        s = by["1x256x1"]
        data.update(single_decode_ms=s["step_ms"] + s["sample_ms"] + s["host_ms"],
                    single_decode_roofline_ms=s["weight_read_roofline_ms"])
    save("profile_step", data, args)


if __name__ == "__main__":
    main()
