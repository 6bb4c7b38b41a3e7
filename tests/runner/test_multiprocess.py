"""A multi-process engine (jax.distributed, gloo CPU collectives): two local processes with two
forced host devices each serve the same outputs as one process with four, at TP 4 over all
of them, and the follower exits cleanly when process 0 stops; an unreachable coordinator and
inconsistent flags fail in one line. The runs are tests/runner/multiprocess_check.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxkv.engine_args import EngineArgs
from tests.helpers import assert_same_or_near_tie

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(*argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.runner.multiprocess_check", *map(str, argv)],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(p: subprocess.Popen) -> tuple[dict | None, str]:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("MP_RESULT ")), None)
    return (json.loads(line[len("MP_RESULT "):]) if line else None), err


@pytest.fixture(scope="module")
def runs():
    folder = subprocess.run([sys.executable, "-m", "tests.runner.multiprocess_check", "folder", "0", "0"],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, check=True).stdout.split()[-1]
    port = free_port()
    one = check("one", 0, 0, folder)
    p0, p1 = check("two", 0, port, folder), check("two", 1, port, folder)
    (two, err0), (follower, err1), (ref, _) = result(p0), result(p1), result(one)
    return {"one": ref, "two": two, "follower": follower, "err0": err0, "err1": err1}


def test_two_processes_serve_what_one_serves(runs):
    one, two = runs["one"], runs["two"]
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    for i, (a, b) in enumerate(zip(two["greedy"], one["greedy"])):
        margins = [sorted(d.values())[-1] - sorted(d.values())[-2] for d in one["logprobs"][i]]
        assert_same_or_near_tie(a, b, margins, what=f"prompt {i}")
    assert two["seeded"] == one["seeded"]
    assert len({tuple(t) for t in one["greedy"]}) > 1  # the prompts get different answers


def test_the_pool_is_split_across_the_processes(runs):
    two = runs["two"]
    assert two["pool"] == "P(None, None, None, 'tp', None)"
    assert two["local_devices"] == 2  # process 0 holds half of the pool's shards
    assert two["num_free_blocks"] == two["num_total_blocks"]  # every block back after the run


def test_a_second_engine_in_the_job_is_refused(runs):
    assert runs["two"]["second_engine"].startswith("a multi-process engine exists in this process")
    assert runs["one"]["second_engine"] is None  # one process: as many engines as wanted


def test_the_follower_runs_the_steps_and_exits_cleanly(runs):
    assert runs["follower"] is None  # LLM(...) on process 1 never returned: it followed
    assert "process 1 follows process 0's steps" in runs["err1"]
    assert "process 0 stopped after" in runs["err1"]


def test_unreachable_coordinator_fails_in_one_line():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "jaxkv.cli", "generate", "hi", "--num-processes", "2",
                        "--process-id", "1", "--distributed-coordinator", f"127.0.0.1:{port}",
                        "--distributed-timeout", "2", "--tensor-parallel-size", "2"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("jaxkv: error:")]
    assert lines == [f"jaxkv: error: distributed_coordinator 127.0.0.1:{port} unreachable within "
                     "distributed_timeout 2 s (Connection refused)"], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("kw,msg", [
    (dict(num_processes=2, process_id=2), "process_id must be less than num_processes (2), got 2"),
    (dict(process_id=-1), "process_id must be an integer >= 0, got -1"),
    (dict(num_processes=0), "num_processes must be a positive integer, got 0"),
    (dict(distributed_coordinator="nohost"), "distributed_coordinator must be HOST:PORT"),
    (dict(distributed_coordinator="h:99999"), "distributed_coordinator must be HOST:PORT"),
    (dict(distributed_timeout=0), "distributed_timeout must be a positive number of seconds"),
    (dict(num_processes=2, enforce_eager=True), "enforce_eager cannot run a multi-process engine"),
])
def test_bad_values_name_the_argument(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**kw)
