"""Online serving sweep, like `vllm bench serve`, against jaxkv serve or any OpenAI server.

Drives streaming /v1/completions (greedy, ignore_eos, so every output has --output-len tokens)
at each --max-concurrency level in turn: --num-prompts requests per level (default
min(128, max(8, 2 x concurrency)), fresh prompts at every level so the prefix cache never
serves one level's prompts to the next), sent with Poisson arrivals at --request-rate (default
inf: all queued at once, at most max_concurrency in flight). Without --base-url it starts
`jaxkv serve` (embedded model, default engine flags plus --server-args) on a free loopback port,
waits for /health 200 and for /metrics to show every token bucket compiled (the finer ones
compile in the background after /health), sends one untimed warmup request, and stops the
server at the end.

Datasets: random (--input-len random token ids, decoded to text with the model's tokenizer)
and shared-prefix (one --prefix-len random prefix shared by every request + --input-len random
suffix). Per level, with vLLM's definitions: completed and failed requests, duration, request
and output throughput, and mean/median/p99 in ms of TTFT (time to the first streamed token),
TPOT ((E2EL - TTFT) / (output tokens - 1) per request), ITL (gaps between streamed chunks) and
E2EL (request latency). After the sweep, with the server stopped, each level's compute
roofline is measured (benchmarks/roofline.py: its requests' FLOPs over this machine's GEMM
throughput at its decode and prefill step shapes): roofline_tok_s and roofline_fraction
(output throughput over it; the speed issue's target is >= 0.6 at concurrency 64, and output
throughput that never falls as concurrency rises).

Knee: scanning the levels upwards, a level is comfortable when its output throughput is at
least 10% above the previous level's AND its median TPOT and p99 TTFT stay within
--knee-factor (default 4) x the first (lowest) level's; the knee is the last level before the
first uncomfortable one.

Workloads: full (default) = concurrency 1,4,8,16,32,64, input 128 / output 64 tokens, 8-128
prompts per level (256 requests): about 6-7 minutes on 2 CPU cores including server start.
--quick = concurrency 1,4,16, input 64 / output 32, 4/8/32 prompts: about 1.5 minutes.
--compare-llama-cpp runs the same sweep against llama-cpp-python's server on the same GGUF
afterwards (reported as "unavailable" when llama-cpp-python is not installed).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import base_parser, print_table, save
from roofline import workload_roofline

METRICS = ("ttft", "tpot", "itl", "e2el")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on loopback, ready once `ready_path` answers 200."""

    def __init__(self, cmd: list[str], port: int, ready_path: str, timeout: float = 600):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        import httpx
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"{' '.join(cmd[1:4])} did not become ready:\n{tail}")
            try:
                if httpx.get(self.url + ready_path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)

    def tail(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-30:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log.name)


def load_tokenizer(name: str | None):
    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
    if name is None or name.endswith(".gguf"):
        return tokenizer_from_gguf(name or embedded_model_path())
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(name)


def make_prompts(tok, rng, n: int, input_len: int, prefix: str = "") -> list[str]:
    """Random token ids decoded to text, re-encoded and cut to input_len (as vLLM's random set)."""
    def one():
        text = tok.decode(rng.integers(100, tok.vocab_size, size=input_len + 8).tolist())
        return prefix + tok.decode(tok.encode(text, add_special_tokens=False)[:input_len])
    return [one() for _ in range(n)]


async def one_request(client, url, body, sem, delay):
    await asyncio.sleep(delay)
    async with sem:
        rec = {"ok": False, "ttft": None, "itl": [], "e2el": None, "out": 0, "prompt_tokens": None}
        t0 = time.perf_counter()
        last, chunks = t0, 0
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    data, now = json.loads(line[5:]), time.perf_counter()
                    if data.get("choices") and data["choices"][0].get("text"):
                        if rec["ttft"] is None:
                            rec["ttft"] = now - t0
                        else:
                            rec["itl"].append(now - last)
                        last, chunks = now, chunks + 1
                    if data.get("usage"):
                        rec["out"] = data["usage"].get("completion_tokens") or 0
                        rec["prompt_tokens"] = data["usage"].get("prompt_tokens")
            rec["e2el"] = time.perf_counter() - t0
            rec["out"] = rec["out"] or chunks
            rec["ok"] = rec["ttft"] is not None
        except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
            rec["error"] = f"{type(e).__name__}: {e}"
        return rec


async def run_level(url, model, prompts, args, conc, extra, rng):
    import httpx
    sem = asyncio.Semaphore(conc)
    gaps = (np.zeros(len(prompts)) if args.request_rate == float("inf")
            else rng.exponential(1 / args.request_rate, size=len(prompts)))
    delays = np.cumsum(gaps) - gaps[0]
    bodies = [{"model": model, "prompt": p, "max_tokens": args.output_len, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}, **extra} for p in prompts]
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one_request(client, url, b, sem, d) for b, d in zip(bodies, delays)))
        duration = time.perf_counter() - t0
    return summarize(recs, conc, duration)


def summarize(recs, conc, duration) -> dict:
    ok = [r for r in recs if r["ok"]]
    vals = {"ttft": [r["ttft"] for r in ok], "e2el": [r["e2el"] for r in ok],
            "itl": [x for r in ok for x in r["itl"]],
            "tpot": [(r["e2el"] - r["ttft"]) / (r["out"] - 1) for r in ok if r["out"] > 1]}
    out_tokens = sum(r["out"] for r in ok)
    prompt_toks = [r["prompt_tokens"] for r in ok if r["prompt_tokens"]]
    level = {"max_concurrency": conc, "completed": len(ok), "failed": len(recs) - len(ok),
             "duration_s": duration, "request_throughput": len(ok) / duration,
             "output_throughput": out_tokens / duration, "total_output_tokens": out_tokens,
             "mean_prompt_tokens": float(np.mean(prompt_toks)) if prompt_toks else None}
    for m in METRICS:
        v = np.array(vals[m]) * 1000
        level.update({f"mean_{m}_ms": float(v.mean()) if v.size else None,
                      f"median_{m}_ms": float(np.median(v)) if v.size else None,
                      f"p99_{m}_ms": float(np.percentile(v, 99)) if v.size else None})
    level["first_error"] = next((r["error"] for r in recs if "error" in r), None)
    return level


def knee(levels, factor) -> int | None:
    """Last level before the first whose throughput grew < 10% over the previous level or
    whose median TPOT / p99 TTFT exceed `factor` x the first level's (see the docstring)."""
    if not levels or levels[0]["completed"] == 0:
        return None
    base, best = levels[0], levels[0]["max_concurrency"]
    for prev, cur in itertools.pairwise(levels):
        if (cur["failed"] or cur["completed"] == 0
                or cur["output_throughput"] < 1.10 * prev["output_throughput"]
                or cur["median_tpot_ms"] > factor * base["median_tpot_ms"]
                or cur["p99_ttft_ms"] > factor * base["p99_ttft_ms"]):
            break
        best = cur["max_concurrency"]
    return best


def wait_for_buckets(url: str, timeout: float = 600.0) -> None:
    """Wait until a jaxkv server's /metrics shows every token bucket compiled (the ones
    compiled after /health turned 200 land in the background), so the sweep times the steady
    state; returns at once for a server without those series."""
    import httpx
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        r = httpx.get(url + "/metrics", timeout=30)
        vals = {ln.split("{")[0].split()[0]: float(ln.split()[-1]) for ln in r.text.splitlines()
                if ln.startswith(("jaxkv:num_token_buckets", "jaxkv:num_compiled_token_buckets"))}
        if r.status_code != 200 or len(vals) < 2:
            return
        if vals["jaxkv:num_compiled_token_buckets"] >= vals["jaxkv:num_token_buckets"]:
            print(f"all token buckets compiled after {time.perf_counter() - t0:.0f} s more", flush=True)
            return
        time.sleep(2)
    print(f"token buckets still compiling after {timeout:.0f} s: timing anyway", flush=True)


def engine_counters(url: str) -> dict:
    """A jaxkv server's step counters from /metrics: steps, steps that used a step dispatched
    ahead (0 without async scheduling), the engine thread's CPU seconds; {} for a server
    without them."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(url + "/metrics", timeout=30)
    if r.status_code != 200:
        return {}
    got = {}
    for fam in text_string_to_metric_families(r.text):
        for x in fam.samples:
            if x.name == "jaxkv:engine_steps_total":
                got["steps"] = x.value
            elif x.name == "jaxkv:engine_host_cpu_seconds_total":
                got["host_s"] = x.value
            elif x.name == "jaxkv:async_steps_total" and x.labels.get("outcome") == "used":
                got["ahead"] = x.value
    if "steps" not in got or "host_s" not in got:
        return {}
    return {"ahead": 0.0, **got}  # (no async series: async scheduling is off)


def engine_share(before: dict, after: dict) -> dict:
    """steps_dispatched_ahead (the share of the level's engine steps that used a step
    dispatched ahead: async scheduling, issue 38's >= 0.8 at concurrency 32) and the engine
    thread's CPU ms per step, from two engine_counters readings."""
    steps = after.get("steps", 0) - before.get("steps", 0)
    if not before or not after or steps <= 0:
        return {}
    return {"engine_steps": int(steps),
            "steps_dispatched_ahead": round((after["ahead"] - before["ahead"]) / steps, 3),
            "host_cpu_ms_per_step": round(1e3 * (after["host_s"] - before["host_s"]) / steps, 3)}


def sweep(url, model, tok, args, levels, extra, label) -> dict:
    import httpx
    if model is None:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng, arrivals = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    prefix = ""
    if args.dataset == "shared-prefix":
        prefix = make_prompts(tok, rng, 1, args.prefix_len)[0]
    wait_for_buckets(url)
    warm = make_prompts(tok, np.random.default_rng(10_000 + args.seed), 1, args.input_len, prefix)
    w = asyncio.run(run_level(url, model, warm, args, 1, extra, arrivals))  # untimed warmup
    if not w["completed"]:
        raise RuntimeError(f"the warmup request to {url} failed: {w['first_error']}")
    out = []
    for conc in levels:
        n = args.num_prompts or min(args.max_prompts, max(args.min_prompts, 2 * conc))
        prompts = make_prompts(tok, rng, n, args.input_len, prefix)
        before = engine_counters(url)
        lv = asyncio.run(run_level(url, model, prompts, args, conc, extra, arrivals))
        lv["num_prompts"] = n
        lv.update(engine_share(before, engine_counters(url)))
        out.append(lv)
        print(f"[{label}] concurrency {conc:>3}: {lv['completed']}/{n} ok in {lv['duration_s']:.1f} s, "
              f"{lv['output_throughput']:.1f} tok/s, median TTFT {lv['median_ttft_ms'] or 0:.0f} ms, "
              f"median TPOT {lv['median_tpot_ms'] or 0:.0f} ms"
              + (f", steps dispatched ahead {lv['steps_dispatched_ahead']}" if "engine_steps" in lv else "")
              + (f"  ({lv['first_error']})" if lv.get("first_error") else ""),
              flush=True)
    return {"levels": out, "knee_concurrency": knee(out, args.knee_factor), "model": model}


def add_rooflines(levels, args, max_num_seqs: int = 64, budget: int = 512) -> None:
    """Each level's compute roofline (benchmarks/roofline.py), measured now that the server
    has stopped: its requests' FLOPs (mean prompt tokens, output_len new tokens each) over
    this machine's GEMM throughput at its decode rows (min(concurrency, max_num_seqs)) and the
    prefill budget; roofline_fraction = output_throughput / roofline_tok_s."""
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig
    cfg = ModelConfig.from_hf_config(read_config(args.model_path))
    for lv in levels:
        if not lv["completed"] or not lv["mean_prompt_tokens"]:
            continue
        roof = workload_roofline(cfg, [round(lv["mean_prompt_tokens"])] * lv["completed"],
                                 args.output_len, decode_rows=min(lv["max_concurrency"], max_num_seqs),
                                 prefill_rows=budget)
        lv["roofline_tok_s"] = roof["roofline_tok_s"]
        lv["roofline_fraction"] = lv["output_throughput"] / roof["roofline_tok_s"]


def start_jaxkv(args) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxkv.cli", "serve", "--port", str(port), "--disable-uvicorn-access-log",
           *(["--model", args.model_path] if args.model_path else []), *args.server_args.split()]
    return Server(cmd, port, "/health")


def start_llama_cpp(args) -> Server:
    from jaxkv.loader.gguf import embedded_model_path
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.model_path or embedded_model_path(),
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
           "--n_threads", str(os.cpu_count())]
    return Server(cmd, port, "/v1/models")


def main():
    ap = base_parser(__doc__,
                     "concurrency 1,4,16, input 64 / output 32 tokens, 4/8/32 prompts (about 1.5 minutes)")
    ap.add_argument("--base-url", default=None, help="a running OpenAI-compatible server (default: start jaxkv serve)")
    ap.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    ap.add_argument("--model-path", default=None, help="GGUF / HF folder to serve and tokenize with (default: embedded)")
    ap.add_argument("--server-args", default="",
                    help='extra flags for the jaxkv serve this script starts, e.g. --server-args="--max-num-seqs 32"')
    ap.add_argument("--max-concurrency", default=None, help="comma list (default 1,4,8,16,32,64; --quick 1,4,16)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: see above)")
    ap.add_argument("--min-prompts", type=int, default=None, help="default 8 (--quick 4)")
    ap.add_argument("--max-prompts", type=int, default=128, help="default 128")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson requests/s (default inf)")
    ap.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128, --quick 64)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens (default 64, --quick 32)")
    ap.add_argument("--prefix-len", type=int, default=512, help="shared-prefix dataset: shared tokens")
    ap.add_argument("--knee-factor", type=float, default=4.0, help="knee latency limit, x the lowest level's")
    ap.add_argument("--compare-llama-cpp", action="store_true", help="also sweep llama-cpp-python's server")
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    args = ap.parse_args()
    q = args.quick
    levels = [int(x) for x in (args.max_concurrency or ("1,4,16" if q else "1,4,8,16,32,64")).split(",")]
    args.input_len = args.input_len or (64 if q else 128)
    args.output_len = args.output_len or (32 if q else 64)
    args.min_prompts = args.min_prompts or (4 if q else 8)
    tok = load_tokenizer(args.model_path)
    extra = {"ignore_eos": True}
    t_start = time.perf_counter()

    server = None if args.base_url else start_jaxkv(args)
    url = args.base_url.rstrip("/").removesuffix("/v1") if args.base_url else server.url
    print(f"server {url} ready after {time.perf_counter() - t_start:.0f} s; dataset {args.dataset}, "
          f"input {args.input_len} / output {args.output_len} tokens, request rate {args.request_rate}", flush=True)
    try:
        res = sweep(url, args.model, tok, args, levels, extra, "jaxkv" if server else url)
    finally:
        if server:
            server.stop()

    other = None
    if args.compare_llama_cpp:
        if importlib.util.find_spec("llama_cpp") is None:
            other = "unavailable"
            print("llama-cpp-python is not installed: comparison unavailable")
        else:
            srv = None
            try:  # llama.cpp knows no ignore_eos: a strong negative bias on EOS does the same
                srv = start_llama_cpp(args)
                other = sweep(srv.url, None, tok, args, levels,
                              {"logit_bias": {str(tok.eos_token_id): -100}}, "llama-cpp")
            except Exception as e:  # keep jaxkv's sweep: report the comparison as failed
                other = f"failed: {type(e).__name__}: {e}"
                print(f"llama-cpp-python comparison {other}")
            finally:
                if srv is not None:
                    srv.stop()

    add_rooflines(res["levels"], args)
    cols = ["max_concurrency", "completed", "failed", "duration_s", "request_throughput", "output_throughput",
            "roofline_fraction",
            *(f"{s}_{m}_ms" for m in METRICS for s in ("median", "p99"))]
    print()
    print_table(res["levels"], cols, "{:.1f}")
    print(f"knee (comfortable concurrency): {res['knee_concurrency']}")
    data = {"levels": res["levels"], "knee_concurrency": res["knee_concurrency"], "dataset": args.dataset,
            "input_len": args.input_len, "output_len": args.output_len, "request_rate": str(args.request_rate),
            "server": "jaxkv serve (started here)" if server else url}
    if args.compare_llama_cpp:
        data["llama_cpp"] = other
        if isinstance(other, dict):
            print("\nllama-cpp-python server:")
            print_table(other["levels"], cols, "{:.1f}")
            for a, b in zip(res["levels"], other["levels"]):
                if a["max_concurrency"] == 32 and b["output_throughput"]:
                    data["output_throughput_ratio_at_32"] = a["output_throughput"] / b["output_throughput"]
    print(f"total run time {time.perf_counter() - t_start:.0f} s")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    runs = [("jaxkv", res)] + ([("llama-cpp-python", other)] if isinstance(other, dict) else [])
    for name, r in runs:
        c = [lv["max_concurrency"] for lv in r["levels"]]
        style = "-o" if name == "jaxkv" else "--s"
        for ax, m in zip(axes[:2], ("ttft", "tpot")):
            ax.plot(c, [lv[f"median_{m}_ms"] for lv in r["levels"]], style, label=f"{name} median")
            ax.plot(c, [lv[f"p99_{m}_ms"] for lv in r["levels"]], style, alpha=0.5, label=f"{name} p99")
        axes[2].plot(c, [lv["output_throughput"] for lv in r["levels"]], style, label=name)
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "output tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="max concurrency", title=title, xticks=levels, xticklabels=[str(c) for c in levels])
        if res["knee_concurrency"]:
            ax.axvline(res["knee_concurrency"], color="grey", ls=":", label=f"knee = {res['knee_concurrency']}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{args.dataset} dataset, input {args.input_len} / output {args.output_len} tokens", y=1.03)
    save("serving", data, args, fig)


if __name__ == "__main__":
    main()
