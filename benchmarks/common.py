"""What every benchmark script shares: flags, the machine record, workloads of random token
ids, a readable table, and the results (benchmarks/results/<name>.json + .png, and ONE JSON line
on stdout as the last line).

Rules (see the benchmarks issue): workloads are fixed by the seed; tokens/s = output tokens /
wall time of the measured call, after an untimed warmup; ratios are measured side by side in
the same run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def timed(fn, *args, iters: int) -> tuple[float, float]:
    """(first call incl. compile, median of `iters` calls) in seconds; each call waits for its
    device work (jax.block_until_ready)."""
    import time

    import jax
    import numpy as np
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return first, float(np.median(ts))


def base_parser(description: str, quick: str) -> argparse.ArgumentParser:
    """--seed, --quick (its workload described by `quick`), --out-dir."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--quick", action="store_true", help=f"smaller fixed workload: {quick}")
    p.add_argument("--out-dir", default=RESULTS_DIR, help="where the .json and .png go")
    return p


def machine_info() -> dict:
    """CPU model, core count, Python / jax versions and the device JAX runs on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "date": _dt.date.today().isoformat()}
    try:
        import jax
        d = jax.devices()[0]
        info.update(jax=jax.__version__, device=f"{d.platform}:{getattr(d, 'device_kind', '')}")
    except Exception as e:  # noqa: BLE001 - the record must not stop a benchmark
        info["device"] = f"unknown ({e})"
    return info


def random_prompts(rng, num: int, lo: int, hi: int, vocab: int = 49152) -> list[list[int]]:
    """`num` prompts of random ordinary token ids (ids below 100 hold the special tokens),
    lengths uniform in [lo, hi]."""
    lens = rng.integers(lo, hi + 1, size=num)
    return [rng.integers(100, vocab, size=int(n)).tolist() for n in lens]


def print_table(rows: list[dict], columns: list[str] | None = None, floatfmt: str = "{:.2f}") -> None:
    if not rows:
        return
    columns = columns or list(rows[0])
    cells = [[floatfmt.format(r.get(c)) if isinstance(r.get(c), float) else str(r.get(c)) for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def save(name: str, data: dict, args, fig=None) -> str:
    """Write <out_dir>/<name>[-quick].json (data + machine + args) and the figure as .png, then
    print the numbers as the one JSON line that ends the output. Returns the JSON path."""
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, name + ("-quick" if args.quick else ""))
    record = {**data, "machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "out_dir"},
              "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])}
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    if fig is not None:
        fig.savefig(stem + ".png", dpi=110, bbox_inches="tight")
    sys.stdout.flush()
    print(json.dumps(data))
    return stem + ".json"


def model_folder(config: dict) -> str:
    """A temporary model folder of `config` (config.json) with the embedded model's tokenizer,
    for engines of random weights (load_format="dummy")."""
    import tempfile

    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
    d = tempfile.mkdtemp(prefix="jaxkv-bench-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    tokenizer_from_gguf(embedded_model_path()).save_pretrained(d)
    return d


def decode_step_ms(llm, batch: int, context: int, reps: int, seed: int) -> float:
    """Median ms of the engine's device-only decode step (runner.forward) for `batch`
    sequences of `context` tokens each (the pool must hold them), after a warmup call."""
    from benchmarks.profile_step import scheduler_output
    runner = llm.llm_engine.runner
    si = runner.build_inputs(scheduler_output(batch, context, 1, runner.block_size, seed))
    return timed(lambda: runner.forward(si), iters=reps)[1] * 1e3
