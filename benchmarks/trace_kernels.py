"""What the GPU did in a jax.profiler trace: busy and idle time, and kernel time by kind.

  python -m benchmarks.trace_kernels TRACE.json.gz [--with paged_attention_decode] [--last 3]

A Chrome trace (what `jax.profiler.trace` writes, `perfetto_trace.json.gz` or
`*.trace.json.gz`) holds one "X" event per kernel on the processes named after a GPU. The
engine's steps show there as bursts of kernels split by the host's gaps (`--step-gap-ms`).
The command line prints, for the bursts holding a kernel whose name contains `--with`
(default: every burst; the last `--last` of them), each burst's span, busy time, kernel count,
kernels per XLA module (a burst may hold two steps, or a step and its sampler program, when
the host's gap between them was short) and time by kind, and the kernels of the last one
grouped by name. Memory copies are not kernels here. `benchmarks/gpu_engine.py`
puts `gpu_idle` and `kernel_mix` of its trace stage in its rows.

Kinds, by kernel name (XLA names a fusion after its root, cuBLAS's Hopper kernels are
"nvjet_*"): gemm (cuBLAS and XLA's Triton gemm fusions), attention (the Pallas kernels),
kv_write (XLA's scatter fusions: the K/V write into the pool), other (norms, RoPE, residual
adds, activations, sampling). `in_graphs`: the share of kernel time in a command buffer (a
CUDA graph: the event's args carry a cuda_graph_id).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

GEMM = ("gemm", "gemv", "nvjet", "cutlass", "cublas", "xmma", "sm90_", "matmul", "splitk")


def load_kernels(path: str) -> list[dict]:
    """The GPU kernel events ("X" events of the processes named after a GPU; memory copies
    left out), by start time, from a trace file or the newest-layout file under a folder
    jax.profiler wrote (perfetto_trace.json.gz first); [] when there is none or it holds no
    GPU event. FileNotFoundError for a path that does not exist."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no trace at {path}")
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*trace.json.gz"), recursive=True),
                       key=lambda f: "perfetto" not in f)
        if not files:
            return []
        path = files[0]
    ev = json.load(gzip.open(path))["traceEvents"]
    pids = {e["pid"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"
            and "GPU" in str(e.get("args", {}).get("name"))}
    return sorted((e for e in ev if e.get("ph") == "X" and e.get("pid") in pids and not _copy(e)),
                  key=lambda e: e["ts"])


def _copy(e: dict) -> bool:
    """A memory copy (host <-> device, device to device), not a kernel."""
    return "memcpy_details" in e.get("args", {}) or e["name"].lower().startswith("memcpy")


def busy_us(ks: list[dict]) -> float:
    """The union of the kernels' [ts, ts + dur) intervals, µs (streams overlapping count once)."""
    if not ks:
        return 0.0
    busy, lo, hi = 0.0, ks[0]["ts"], ks[0]["ts"]
    for e in ks:
        if e["ts"] > hi:
            busy, lo = busy + hi - lo, e["ts"]
        hi = max(hi, e["ts"] + e["dur"])
    return busy + hi - lo


def span_us(ks: list[dict]) -> float:
    """From the first kernel's start to the last end, µs."""
    return max(e["ts"] + e["dur"] for e in ks) - ks[0]["ts"] if ks else 0.0


def gpu_idle(ks: list[dict], steps: int) -> dict:
    """GPU busy ms, idle ms and the idle share over the kernels' span, and kernels per step
    (`steps` engine steps traced); Nones without kernels (a CPU trace)."""
    if not ks:
        return {"gpu_busy_ms": None, "gpu_idle_ms": None, "gpu_idle_share": None}
    busy, span = busy_us(ks), span_us(ks)
    return {"gpu_busy_ms": round(busy / 1e3, 2), "gpu_idle_ms": round((span - busy) / 1e3, 2),
            "gpu_idle_share": round(1 - busy / span, 4), "kernels_per_step": len(ks) // steps}


def kind(name: str) -> str:
    """gemm, attention, kv_write or other, from a kernel's name (the module docstring)."""
    n = name.lower()
    if "attention" in n:
        return "attention"
    if any(g in n for g in GEMM):
        return "gemm"
    return "kv_write" if "scatter" in n else "other"


def kernel_mix(ks: list[dict], steps: int, top: int = 8) -> dict:
    """Kernel time per step by kind (ms, each kernel's own duration), the share of it in a
    command buffer, and the `top` kernel names by time (ms and calls per step); {} without
    kernels."""
    if not ks:
        return {}
    by_kind, by_name, calls = collections.Counter(), collections.Counter(), collections.Counter()
    graphed = 0.0
    for e in ks:
        by_kind[kind(e["name"])] += e["dur"]
        by_name[e["name"]] += e["dur"]
        calls[e["name"]] += 1
        graphed += e["dur"] if "cuda_graph_id" in e.get("args", {}) else 0.0
    total = sum(by_kind.values())
    return {"kernel_ms_per_step": {k: round(v / 1e3 / steps, 3) for k, v in sorted(by_kind.items())},
            "in_graphs": round(graphed / total, 4) if total else None,
            "top_kernels": [[n[:60], round(d / 1e3 / steps, 3), round(calls[n] / steps, 1)]
                            for n, d in by_name.most_common(top)]}


def bursts(ks: list[dict], gap_us: float) -> list[list[dict]]:
    """The kernels split wherever the GPU idles longer than `gap_us` (the host's gap between
    steps)."""
    out, end = [], None
    for e in ks:
        if end is None or e["ts"] - end > gap_us:
            out.append([])
            end = e["ts"]
        out[-1].append(e)
        end = max(end, e["ts"] + e["dur"])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="a trace.json.gz, or the folder jax.profiler wrote")
    ap.add_argument("--step-gap-ms", type=float, default=1.0)
    ap.add_argument("--with", dest="having", default="", help="bursts holding a kernel so named")
    ap.add_argument("--last", type=int, default=3)
    a = ap.parse_args(argv)
    if not os.path.exists(a.trace):
        raise SystemExit(f"no trace at {a.trace}")
    ks = load_kernels(a.trace)
    if not ks:
        raise SystemExit("no GPU kernels in this trace")
    print(json.dumps({"all": gpu_idle(ks, 1) | {"kernels": len(ks)}}))
    picked = [b for b in bursts(ks, 1e3 * a.step_gap_ms) if any(a.having in e["name"] for e in b)]
    print(f"{len(picked)} bursts hold a kernel named {a.having!r}")
    for b in picked[-a.last:]:
        mix = kernel_mix(b, 1)
        modules = collections.Counter(e.get("args", {}).get("hlo_module", "?") for e in b)
        print(json.dumps({"span_ms": round(span_us(b) / 1e3, 3), "busy_ms": round(busy_us(b) / 1e3, 3),
                          "kernels": len(b), "modules": dict(modules),
                          **{k: mix[k] for k in ("kernel_ms_per_step", "in_graphs")}}))
    if picked:
        for name, ms, n in kernel_mix(picked[-1], 1, top=25)["top_kernels"]:
            print(f"{ms:8.3f} ms {n:6.0f}x  {name}")


if __name__ == "__main__":
    main()
