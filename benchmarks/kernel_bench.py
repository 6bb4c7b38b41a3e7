"""Paged-attention kernels on the device: a smoke test, and timings against jaxkv's XLA path.

  python -m benchmarks.kernel_bench smoke     # both kernels lower, run, and match the oracle
  python -m benchmarks.kernel_bench sweep     # decode grid + a mixed batch: µs and GB/s
  add --cpu-dry-run to run the same code on a CPU with tiny shapes in interpret mode.

Sweep (bfloat16, 32 query heads, 8 KV heads, head_dim 128, block 16): decode over num_seqs
{1, 8, 64, 256} x context {512, 2048, 8192} with paged_attention (decode kernel, with and
without split-K), ragged_paged_attention and jaxkv's XLA path (jaxkv/attention/xla_ragged.py);
then a mixed batch of 4 prefill chunks of 512 tokens (the last 512 of 2048-token contexts) and
60 decodes at context 2048. The smoke stage checks against pallas_kernels/reference.py.
GB/s = K/V bytes the step must read (context tokens x 2 x num_kv_heads x head_dim x 2 B) /
time, shown next to the device-to-device copy bandwidth measured here ((read + write) / time).
Each row is written as soon as it is measured (benchmarks/result_rows.py).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import timed
from benchmarks.result_rows import Rows
from pallas_kernels import paged_attention, ragged_paged_attention
from jaxkv.attention.xla_ragged import xla_ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference

FULL = dict(heads=32, kv_heads=8, head_dim=128, block_size=16, seqs=(1, 8, 64, 256),
            contexts=(512, 2048, 8192), mixed=(4, 512, 60, 2048), iters=10)
TINY = dict(heads=4, kv_heads=2, head_dim=32, block_size=8, seqs=(1, 3), contexts=(20, 40),
            mixed=(2, 8, 3, 24), iters=2)


def make_pool(num_blocks, cfg, dtype, seed=0):
    shape = (num_blocks, cfg["block_size"], cfg["kv_heads"], cfg["head_dim"])
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(kk, shape, jnp.float32).astype(dtype),
            jax.random.normal(kv, shape, jnp.float32).astype(dtype))


def batch(rng, ctx_lens, q_lens, num_blocks, width, cfg, dtype):
    """Ragged step arrays with random-permutation block tables; q [sum(q_lens), H, D]."""
    bs = cfg["block_size"]
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(ctx_lens), width), np.int32)
    used = 0
    for s, c in enumerate(ctx_lens):
        nb = -(-c // bs)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(qsl[-1]), cfg["heads"], cfg["head_dim"])), dtype)
    return (q, jnp.asarray(tables), jnp.asarray(np.asarray(ctx_lens, np.int32)), jnp.asarray(qsl),
            jnp.array([len(ctx_lens)], jnp.int32))


def kv_bytes(ctx_lens, cfg, dtype) -> int:
    return int(sum(ctx_lens)) * 2 * cfg["kv_heads"] * cfg["head_dim"] * jnp.dtype(dtype).itemsize


def smoke(cfg, interpret: bool):
    rows = Rows("1_smoke")
    rng = np.random.default_rng(0)
    for dtype in (jnp.bfloat16, jnp.float32):
        k, v = make_pool(64, cfg, dtype)
        q, bt, sl, qsl, ns = batch(rng, [37, 5, 20], [1, 5, 7], 64, 8, cfg, dtype)
        scale = cfg["head_dim"] ** -0.5
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(ragged_paged_attention_reference(
                *(x.astype(jnp.float32) for x in (q, k, v)), bt, sl, qsl, ns, scale=scale))
        t0 = time.perf_counter()
        out = ragged_paged_attention(q, k, v, bt, sl, qsl, ns, scale=scale, interpret=interpret)
        err = float(np.max(np.abs(np.asarray(out, np.float32) - ref)) / np.max(np.abs(ref)))
        rows.add(kernel="ragged_paged_attention", dtype=jnp.dtype(dtype).name, rel_err=err,
                 ok=bool(err < (1e-2 if dtype == jnp.bfloat16 else 1e-5)),
                 seconds=round(time.perf_counter() - t0, 2), device=str(jax.devices()[0]))
        dq, dbt, dsl, _, _ = batch(rng, [37, 5, 20], [1, 1, 1], 64, 8, cfg, dtype)
        with jax.default_matmul_precision("highest"):
            dref = np.asarray(ragged_paged_attention_reference(
                *(x.astype(jnp.float32) for x in (dq, k, v)), dbt, dsl,
                jnp.arange(4, dtype=jnp.int32), jnp.array([3], jnp.int32), scale=scale))
        for splits in (1, 2):
            t0 = time.perf_counter()
            out = paged_attention(dq, k, v, dbt, dsl, scale=scale, num_splits=splits,
                                  interpret=interpret)
            err = float(np.max(np.abs(np.asarray(out, np.float32) - dref)) / np.max(np.abs(dref)))
            rows.add(kernel=f"paged_attention(num_splits={splits})", dtype=jnp.dtype(dtype).name,
                     rel_err=err, ok=bool(err < (1e-2 if dtype == jnp.bfloat16 else 1e-5)),
                     seconds=round(time.perf_counter() - t0, 2), device=str(jax.devices()[0]))


def copy_bandwidth(nbytes: int, iters: int) -> float:
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    _, t = timed(f, x, iters=iters)
    return 2 * x.nbytes / t / 1e9


def sweep(cfg, interpret: bool):
    rows = Rows("3_kernels")
    dtype = jnp.bfloat16
    bs, iters = cfg["block_size"], cfg["iters"]
    scale = cfg["head_dim"] ** -0.5
    copy_gbs = copy_bandwidth(1 << (30 if not interpret else 20), iters)
    rows.add(what="device-to-device copy", GBps=round(copy_gbs, 1), device=str(jax.devices()[0]))
    width = max(cfg["contexts"]) // bs + 1
    num_blocks = max(cfg["seqs"]) * (width - 1) + 1
    k, v = make_pool(num_blocks, cfg, dtype)
    rng = np.random.default_rng(0)
    # The pool is an argument, never a closed-over constant of the jitted function.
    impls = {
        "paged_attention": jax.jit(lambda k, v, q, bt, sl: paged_attention(
            q, k, v, bt, sl, scale=scale, interpret=interpret)),
        "paged_attention(num_splits=8)": jax.jit(lambda k, v, q, bt, sl: paged_attention(
            q, k, v, bt, sl, scale=scale, num_splits=8, interpret=interpret)),
        "ragged_paged_attention": jax.jit(lambda k, v, q, bt, sl, qsl, ns: ragged_paged_attention(
            q, k, v, bt, sl, qsl, ns, scale=scale, interpret=interpret)),
        "xla": jax.jit(lambda k, v, q, bt, sl, qsl, ns: xla_ragged_paged_attention(
            q, k, v, bt, sl, qsl, ns, scale=scale)),
    }
    for n in cfg["seqs"]:
        for c in cfg["contexts"]:
            q, bt, sl, qsl, ns = batch(rng, [c] * n, [1] * n, num_blocks, width, cfg, dtype)
            nbytes = kv_bytes([c] * n, cfg, dtype)
            for name, fn in impls.items():
                args = (k, v, q, bt, sl) if name.startswith("paged") else (k, v, q, bt, sl, qsl, ns)
                first, t = timed(fn, *args, iters=iters)
                rows.add(batch="decode", num_seqs=n, context=c, impl=name, us=round(t * 1e6, 1),
                         GBps=round(nbytes / t / 1e9, 1), copy_GBps=round(copy_gbs, 1),
                         first_call_s=round(first, 2))
    p, plen, d, dctx = cfg["mixed"]
    ctx = [dctx] * (p + d)
    q, bt, sl, qsl, ns = batch(rng, ctx, [plen] * p + [1] * d, num_blocks, width, cfg, dtype)
    nbytes = kv_bytes(ctx, cfg, dtype)
    for name in ("ragged_paged_attention", "xla"):
        first, t = timed(impls[name], k, v, q, bt, sl, qsl, ns, iters=iters)
        rows.add(batch=f"mixed {p}x{plen} prefill + {d} decodes", num_seqs=p + d, context=dctx,
                 impl=name, us=round(t * 1e6, 1), GBps=round(nbytes / t / 1e9, 1),
                 copy_GBps=round(copy_gbs, 1), first_call_s=round(first, 2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", choices=["smoke", "sweep"])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="tiny shapes, interpret mode: exercise the script on a CPU")
    a = ap.parse_args(argv)
    cfg = TINY if a.cpu_dry_run else FULL
    interpret = a.cpu_dry_run
    if not interpret and jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU (backend {jax.default_backend()}); use --cpu-dry-run")
    (smoke if a.stage == "smoke" else sweep)(cfg, interpret)


if __name__ == "__main__":
    main()
