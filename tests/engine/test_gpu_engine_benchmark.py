"""benchmarks/gpu_engine.py --cpu-dry-run: every stage of the GPU engine benchmark runs on a
tiny model on the CPU (the Pallas kernels interpreted) and writes its rows, so the script a
lent H200 runs has run here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_dry_run_writes_every_stage(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_engine", "--cpu-dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu",
                            "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "5_gpu_engine.jsonl").read_text().splitlines()]
    by = {}
    for r in rows:
        by.setdefault(r["stage"], []).append(r)
    assert [(r["batch"], r["num_scheduler_steps"], r["launched"]) for r in by["decode"]] == [
        (1, 1, False), (1, 1, True), (4, 1, False), (4, 1, True), (1, 4, True), (4, 4, True)]
    assert by["decode"][-1]["engine_steps"] < by["decode"][3]["engine_steps"]  # 4 tokens a step
    for r in by["decode"]:
        assert r["engine_ms_per_step"] > 0 and r["device_step_ms"] > 0 and r["dispatch_ms"] > 0
        assert 0 <= r["steps_steady"] <= r["steps_dispatched_ahead"] <= 1
        assert r["hlo_moves"] == {}  # the step program moves no MiB-sized value (a tiny model)
    single = [r for r in by["decode"] if r["num_scheduler_steps"] == 1]
    assert all(r["steps_steady"] > 0.5 for r in single)  # the steady batch's fast path
    assert by["trace"][0]["gpu_idle_share"] is None  # no GPU events on the CPU
    assert by["warmup"][0]["programs"] > 0 and by["offline"][0]["output_tok_per_s"] > 0
    off = by["offline"][0]  # requests arriving and finishing: the shares of its steps
    assert 0 <= off["steps_steady"] <= off["steps_dispatched_ahead"] <= 1 and off["host_cpu_ms_per_step"] > 0
    mem = by["memory"]  # every step program: the pool aliased, no pool-sized temporary
    assert mem and all(r["alias_gib"] >= r["pool_gib"] > 0 and r["temp_below_tenth_of_pool"]
                       and r["within_4gib"] for r in mem)
    assert any(r["num_scheduler_steps"] == 4 for r in mem)  # the multistep stage's k-step programs
    s = by["serving"][0]
    assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and 0 <= s["itl_p50_s"] <= s["itl_p99_s"]
    smoke = {r["path"]: r for r in by["smoke"]}
    for path in ("kv_int8", "kv_fp8", "ngram_spec", "prefix_hits"):
        assert smoke[path]["ok"], smoke[path]
    assert smoke["ngram_spec"]["tokens_equal"] == smoke["prefix_hits"]["tokens_equal"] == 1.0
    assert smoke["prefix_hits"]["hits"] > 0 and "structured_outputs" in smoke


def test_the_command_buffer_variants_dry_run(tmp_path):
    """benchmarks/gpu_flags.sh --cpu-dry-run: the decode and trace stages once per XLA_FLAGS
    variant (jaxkv's choices; 2026-12-04's: projections apart, XLA's dot merger on and its
    default command types; those types alone; every dot by cuBLAS; the layers scanned): the
    flags parse and every variant writes its rows (XLA:CPU ignores them; the H200 is where
    they count); an unknown variant is refused."""
    p = subprocess.run(["bash", "benchmarks/gpu_flags.sh", "--cpu-dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    status = [line.split("\t") for line in (tmp_path / "flags.tsv").read_text().splitlines()]
    variants = ("default", "before", "sync", "cublas", "scan")
    assert [(v, ok) for v, ok, *_ in status] == [(v, "ok") for v in variants]
    from jaxkv.runner.xla_options import XLA_DEFAULT_TYPES
    no_conditional = "--xla_gpu_enable_command_buffer=" + XLA_DEFAULT_TYPES.replace("CONDITIONAL,", "")
    assert status[0][3] == "" and status[2][3] == no_conditional and "CONDITIONAL" not in status[2][3]
    assert "dot_merger_threshold_mb=64" in status[1][3] and "--projections unfused" in status[1][3]
    assert f"--xla_gpu_enable_command_buffer={XLA_DEFAULT_TYPES} " in status[1][3]
    assert status[3][3] == "--xla_gpu_enable_triton_gemm=false"
    assert json.loads((tmp_path / "xla_defaults.json").read_text())["xla_default_types_match"] is True
    assert status[4][3] == " (--scan-layers)"
    for variant in variants:
        rows = [json.loads(x) for x in (tmp_path / f"flags_{variant}" / "5_gpu_engine.jsonl").read_text().splitlines()]
        decode = [(r["batch"], r["launched"], r["fused_projections"]) for r in rows if r["stage"] == "decode"]
        assert decode == [(1, False, False), (1, True, False), (4, False, False), (4, True, False)], variant
        assert [r["stage"] for r in rows].count("trace") == 1
        scanned = {r["scan_layers"] for r in rows if r["stage"] == "decode"}
        assert scanned == {variant == "scan"}, variant
    p = subprocess.run(["bash", "benchmarks/gpu_flags.sh", "--cpu-dry-run", "off"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no variant off" in p.stderr
    # A variant by name (the scan fully unrolled), packed as on the lent machine (PACK=1): it
    # returns 8 files at most, none more than two folders down (benchmarks/device_out.sh).
    one = tmp_path / "stacked"
    p = subprocess.run(["bash", "benchmarks/gpu_flags.sh", "--cpu-dry-run", "stacked"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OUT": str(one), "PYTHONPATH": ROOT, "PACK": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    returned = [f for f in one.rglob("*") if f.is_file() and len(f.relative_to(one).parts) <= 3]
    assert sorted(f.name for f in returned) == ["flags.tsv", "gpu_flags.tgz", "xla_defaults.json"]
    assert [line.split("\t")[0] for line in (one / "flags.tsv").read_text().splitlines()] == ["stacked"]
    with tarfile.open(one / "gpu_flags.tgz") as tar:
        rows = [json.loads(x) for x in tar.extractfile("./flags_stacked/5_gpu_engine.jsonl").read().splitlines()]
    assert {(r["scan_layers"], r["scan_unroll"]) for r in rows if r["stage"] == "decode"} == {(True, 2)}


def test_the_dispatch_cost_probe(tmp_path):
    """benchmarks/dispatch_cost.py --cpu-dry-run: a row per argument count (each program read
    every argument and its donated output is what it should be), then the line fitted
    through them; fit() recovers an exact line."""
    from benchmarks import dispatch_cost
    assert dispatch_cost.fit([2, 10, 100], [7.0, 11.0, 56.0]) == pytest.approx((6.0, 0.5))
    p = subprocess.run([sys.executable, "-m", "benchmarks.dispatch_cost", "--cpu-dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "0_dispatch.jsonl").read_text().splitlines()]
    assert [r["args"] for r in rows[:-1]] == [n + 1 for n in dispatch_cost.COUNTS]
    assert all(r["total_us"] >= r["dispatch_us"] > 0 and r["output_right"] for r in rows[:-1])
    assert rows[-1]["stage"] == "fit" and rows[-1]["at_293_args_us"] > 0


def test_the_device_scripts_keep_within_their_budget(tmp_path):
    """The lent machine runs a command for at most 600 s (benchmarks/device_out.sh): a stage
    gets its limit or what is left of GPU_BUDGET less 10 s, and with under 20 s left none
    runs: each is recorded as skipped, most wanted first on gpu_check.sh, and neither script
    fails for it. On the device the budget defaults to 560 s; elsewhere there is none."""
    def seconds(budget, spent, limit, out="", dry=""):  # limit: "LIMIT [MIN]"
        code = (f". benchmarks/device_out.sh; OUT={out} GPU_BUDGET={budget} results_dir x '{dry}'; "
                f"SECONDS={spent}; echo $BUDGET $(stage_seconds {limit})")
        env = {k: v for k, v in os.environ.items() if k not in ("GPU_BUDGET", "OUT")}
        p = subprocess.run(["bash", "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
        return p.stdout.split()
    assert seconds(300, 100, 330) == ["300", "190"] and seconds(300, 100, 60) == ["300", "60"]
    assert seconds(300, 275, 60) == ["300", "0"]  # 15 s left: skipped
    assert seconds(300, 220, "110 90") == ["300", "0"]  # 70 s left, 90 needed: skipped
    assert seconds(300, 200, "110 90") == ["300", "90"]
    assert seconds("", 100, 330) == ["0", "330"]  # no budget off the device

    def status(rc, given, asked):
        p = subprocess.run(["bash", "-c", f". benchmarks/device_out.sh; stage_status {rc} {given} {asked}"],
                           cwd=ROOT, capture_output=True, text=True)
        return p.stdout.strip()
    assert [status(0, 50, 110), status(124, 50, 110), status(124, 110, 110), status(137, 110, 110),
            status(1, 50, 110)] == ["ok", "cut(budget)", "timeout(124)", "timeout(137)", "failed(1)"]
    p = subprocess.run(["bash", "-c", ". benchmarks/device_out.sh; OUT=x GPU_BUDGET=560s results_dir x ''"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "GPU_BUDGET=560s: whole seconds" in p.stderr
    out = tmp_path / "o"
    code = (f"unset GPU_BUDGET; . benchmarks/device_out.sh; OUT={out} results_dir x ''; echo $BUDGET; "
            f"OUT={out} results_dir x --cpu-dry-run; echo $BUDGET")
    p = subprocess.run(["bash", "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.stdout.split() == ["560", "0"]  # the lent machine's default; a dry run has none
    env = {**os.environ, "OUT": str(tmp_path / "check"), "PYTHONPATH": ROOT, "GPU_BUDGET": "1"}
    p = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--cpu-dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    status = [line.split("\t") for line in (tmp_path / "check" / "stages.tsv").read_text().splitlines()]
    assert status == [[name, "skipped(budget)", "0s"] for name in
                      ("0_dispatch", "5_gpu_engine", "2_gpu_tests", "1_smoke", "4_e2e_decode", "3_kernels")]
    p = subprocess.run(["bash", "benchmarks/gpu_flags.sh", "--cpu-dry-run", "cublas", "scan"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**env, "OUT": str(tmp_path / "flags")})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    status = (tmp_path / "flags" / "flags.tsv").read_text().splitlines()
    assert status == ["cublas\tskipped(budget)\t0s\t", "scan\tskipped(budget)\t0s\t"]


def _write_trace(folder, events) -> None:
    import gzip
    run = folder / "plugins" / "profile" / "run"
    run.mkdir(parents=True, exist_ok=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


META = [{"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]


def test_gpu_idle_time_from_a_trace(tmp_path):
    """Two steps on a GPU process, 5 ms apart, one kernel overlapping another on a second
    stream (counted once in the busy time): busy, idle, the idle share and kernels per step
    come from the Chrome trace's events; a CPU-only trace gives Nones."""
    from benchmarks.trace_kernels import gpu_idle, load_kernels
    kernels = [{"ph": "X", "pid": 7, "ts": ts, "dur": 1000, "name": "k"}
               for ts in (0, 1000, 7000, 8000)]
    kernels.append({"ph": "X", "pid": 7, "ts": 7500, "dur": 1000, "name": "other stream"})
    host = [{"ph": "X", "pid": 1, "ts": 0, "dur": 9000, "name": "step"}]
    _write_trace(tmp_path, META + kernels + host)
    assert gpu_idle(load_kernels(str(tmp_path)), 2) == {
        "gpu_busy_ms": 4.0, "gpu_idle_ms": 5.0, "gpu_idle_share": 0.5556, "kernels_per_step": 2}
    _write_trace(tmp_path, META[1:] + host)
    assert load_kernels(str(tmp_path)) == [] and gpu_idle([], 2)["gpu_idle_share"] is None


def test_kernel_time_by_kind_and_steps_from_a_trace(tmp_path, capsys):
    """Kernel names sorted into kinds as the 2026-12-04 H200 trace names them (cuBLAS's
    nvjet_*, XLA's Triton gemm fusions, the Pallas kernels, XLA's scatter fusions for the
    K/V write), per step, with the share run inside CUDA graphs; the command line splits the
    kernels into bursts at the host's gaps and picks those holding a named kernel."""
    from benchmarks import trace_kernels as tk
    names = ["gemm_fusion_dot_32", "input_scatter_fusion_62", "paged_attention_decode",
             "nvjet_sm90_tst_128x128_64x6_4x1_v_bz_NNT", "loop_add_fusion_1"]
    assert [tk.kind(n) for n in names] == ["gemm", "kv_write", "attention", "gemm", "other"]
    assert tk.kind("ragged_paged_attention") == "attention" and tk.kind("gemv2T_kernel") == "gemm"
    graph = {"cuda_graph_id": "194", "hlo_op": "command_buffer_1"}
    kernels, ts = [], 0
    for step in range(2):  # two steps of 5 kernels, 10 us apart within, 2 ms between steps
        for n in names:
            kernels.append({"ph": "X", "pid": 7, "ts": ts, "dur": 100 if "nvjet" in n else 20, "name": n,
                            "args": graph if n != "loop_add_fusion_1" else {}})
            ts += 110
        ts += 2000
    kernels.append({"ph": "X", "pid": 7, "ts": ts, "dur": 5, "name": "sampler_reduce"})  # a burst alone
    kernels.append({"ph": "X", "pid": 7, "ts": 50, "dur": 5, "name": "MemcpyH2D",  # not a kernel
                    "args": {"memcpy_details": "kind_src:pinned"}})
    _write_trace(tmp_path, META + kernels)
    ks = tk.load_kernels(str(tmp_path))
    assert len(ks) == 11 and not any("Memcpy" in e["name"] for e in ks)
    mix = tk.kernel_mix(ks[:10], 2)
    assert mix["kernel_ms_per_step"] == {"attention": 0.02, "gemm": 0.12, "kv_write": 0.02, "other": 0.02}
    assert mix["in_graphs"] == round(160 / 180, 4)
    assert mix["top_kernels"][0] == ["nvjet_sm90_tst_128x128_64x6_4x1_v_bz_NNT", 0.1, 1.0]
    assert [len(b) for b in tk.bursts(ks, 1000)] == [5, 5, 1]
    tk.main([str(tmp_path), "--with", "paged_attention", "--last", "5"])
    out = capsys.readouterr().out
    assert "2 bursts hold a kernel named 'paged_attention'" in out
    assert out.count('"kernels": 5') == 2 and "sampler_reduce" not in out
