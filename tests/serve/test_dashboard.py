"""The live cache page: /kv_cache/blocks agrees with the engine's stats at every poll (free +
cached = free blocks, in use + shared = used blocks, block tables point at held blocks), and
/dashboard, opened by a real headless Chromium while requests run, shows in-use blocks during
the load and none after (a screenshot goes to benchmarks/results/dashboard.png)."""

import pathlib
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from tests.serve.conftest import MODEL

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHROMIUM = next((shutil.which(c) for c in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(c)), None)


def load(server, n=6, tokens=48):
    """n concurrent completions in background threads; returns the threads."""
    story = ("Once upon a time, in a small village between two green hills, there lived an old "
             "baker who woke before dawn every day to bake bread for everyone. One morning")
    body = {"model": MODEL, "prompt": story, "max_tokens": tokens,  # 2 full blocks shared
            "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=server.post, args=("/v1/completions", body)) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def wait_until(cond, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return True
        time.sleep(0.05)
    return False


def snapshot(server):
    r = httpx.get(server.url + "/kv_cache/blocks", timeout=30)
    assert r.status_code == 200
    return r.json()


def check(snap):
    s, k, states = snap["stats"], snap["counts"], snap["states"]
    assert snap["kv_cache_dtype"] == "float32" and snap["bytes_per_token"] == 46080
    assert snap["num_blocks"] == s["num_total_blocks"] + 1 and states[0] == 0 and k["null"] == 1
    assert k["free"] + k["cached"] == s["num_free_blocks"]
    assert k["in use"] + k["shared"] == s["num_total_blocks"] - s["num_free_blocks"]
    holders = {}
    for q in snap["requests"]:
        for b in q["block_ids"]:
            assert states[b] in (3, 4), (q, b)
            holders[b] = holders.get(b, 0) + 1
    for b, n in holders.items():
        assert snap["ref_cnts"][b] >= n
    return k["in use"] + k["shared"]


def test_snapshot_agrees_with_stats_at_every_poll(server):
    threads = load(server)
    used = [check(snapshot(server)) for _ in range(30)]
    for t in threads:
        t.join()
    assert max(used) > 0
    assert wait_until(lambda: check(snapshot(server)) == 0)


def dump_dom(url: str, screenshot: str | None = None) -> str:
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--virtual-time-budget=2500", "--window-size=1100,760"]
    if screenshot:
        subprocess.run(args + [f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    out = subprocess.run(args + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    return out.stdout


def shown(dom: str, field: str) -> int:
    m = re.search(rf'<span id="{field}">(\d+)</span>', dom)
    assert m, f"{field} not rendered: {dom[:400]}"
    return int(m.group(1))


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium)")
def test_dashboard_in_a_real_browser(server):
    page = server.url + "/dashboard"
    threads = load(server, n=8, tokens=200)
    assert wait_until(lambda: check(snapshot(server)) > 0)
    shot = ROOT / "benchmarks" / "results" / "dashboard.png"
    during = dump_dom(page, str(shot))
    for t in threads:
        t.join()
    assert shown(during, "used") > 0 and shown(during, "running") > 0
    assert shown(during, "total") == snapshot(server)["stats"]["num_total_blocks"]
    assert re.search(r'<small id="model">\d+ blocks of 16 tokens, float32, 46,080 bytes per '
                     r'token</small>', during), during[:600]
    assert shot.is_file() and shot.stat().st_size > 10_000
    assert wait_until(lambda: check(snapshot(server)) == 0)
    after = dump_dom(page)
    assert shown(after, "used") == 0 and shown(after, "running") == 0
