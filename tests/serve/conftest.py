"""One real `jaxkv serve` process (embedded model, loopback, a free port) shared by the server
tests, with an API key so that every test also exercises authentication; the embedded model's
tokenizer; and helpers that several server test files import."""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests.conftest import TEST_ENGINE

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
KV_BYTES = TEST_ENGINE["kv_cache_memory_bytes"]  # the same pool as the session engines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, log_path: str, health_codes: list[int]):
        self.url, self.log_path, self.health_codes = url, log_path, health_codes
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def post(self, path: str, body, **kw):
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: 'name{labels}' -> value."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def metric(self, name: str, **labels) -> float:
        want = {"model_name": MODEL, **labels}
        for k, v in self.metrics().items():
            base, _, rest = k.partition("{")
            if base == name and all(f'{a}="{b}"' in rest for a, b in want.items()):
                return v
        raise KeyError(name)


class _Launch:
    """One `jaxkv serve` process and a thread that polls /health from its start until 200
    (or the process ends), recording every status code seen."""

    def __init__(self, extra_args: tuple[str, ...] = ()):
        port = _free_port()
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "jaxkv.cli", "serve", "--port", str(port), "--api-key", API_KEY,
               "--max-model-len", "1024", "--max-num-batched-tokens", "64", "--max-num-seqs", "32",
               "--kv-cache-memory-bytes", str(KV_BYTES), "--enable-tokenizer-info-endpoint",
               "--enable-responses-api-store", "--reasoning-parser", "qwen3",
               # The default buckets for a budget of 64, all compiled at warmup (explicit buckets
               # start no background compile that would compete with the tests for the CPU).
               "--token-buckets", "1,8,64", *extra_args]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.server = Server(f"http://127.0.0.1:{port}", self.log.name, [])
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def _poll(self):
        deadline = time.monotonic() + 600
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                self.server.health_codes.append(httpx.get(self.server.url + "/health", timeout=5).status_code)
                if self.server.health_codes[-1] == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


def launched(extra_args: tuple[str, ...]):
    """A server of its own with `extra_args` for a module's tests (a generator for a fixture:
    yields the Server once healthy, stops it afterwards)."""
    launch = _Launch(extra_args)
    try:
        launch.thread.join()
        assert launch.server.health_codes and launch.server.health_codes[-1] == 200, launch.server.log()
        yield launch.server
    finally:
        launch.stop()


_launched: list[_Launch] = []


def launch_server() -> _Launch:
    """Start the shared server once. tests/conftest.py calls this right after collection when
    any collected test uses it, so its start-up (compiling its programs in its own process)
    overlaps the tests that run before the server tests."""
    if not _launched:
        _launched.append(_Launch())
    return _launched[0]


@pytest.fixture(scope="session")
def server():
    launch = launch_server()
    launch.thread.join()
    srv = launch.server
    try:
        if launch.proc.poll() is not None:
            pytest.fail(f"jaxkv serve exited with {launch.proc.returncode}:\n{srv.log()}")
        if not srv.health_codes or srv.health_codes[-1] != 200:
            pytest.fail(f"jaxkv serve not ready after 600 s:\n{srv.log()}")
        yield srv
    finally:
        launch.stop()


@pytest.fixture(scope="session")
def tok():
    """The embedded model's tokenizer, read from its GGUF."""
    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
    return tokenizer_from_gguf(embedded_model_path())


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def join_tool_calls(r, stream: bool):
    """(content, tool calls as {"id", "name", "arguments"} dicts, finish_reason) of a chat
    response, or of a stream's chunks joined as the openai client's users join deltas."""
    if not stream:
        m = r.choices[0].message
        return m.content, [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                           for t in m.tool_calls or []], r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in r:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                c = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or t.id
                c["name"] += t.function.name or ""
                c["arguments"] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _sse(server, path, body) -> list:
    """The data: payloads of a streamed response, parsed; the last one must be [DONE]."""
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def _err(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param, err
    return err["message"]
