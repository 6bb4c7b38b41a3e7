"""One real `jaxkv serve` process (embedded model, loopback, a free port) shared by the server
tests, with an API key so that every test also exercises authentication."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
KV_BYTES = 128 << 20


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


@pytest.fixture(scope="session")
def server():
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "jaxkv.cli", "serve", "--port", str(port), "--api-key", API_KEY,
           "--max-model-len", "1024", "--max-num-batched-tokens", "64", "--max-num-seqs", "32",
           "--kv-cache-memory-bytes", str(KV_BYTES)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    codes: list[int] = []
    srv = Server(url, log.name, codes)
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jaxkv serve exited with {proc.returncode}:\n{srv.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"jaxkv serve not ready after 300 s:\n{srv.log()}")
            try:
                codes.append(httpx.get(url + "/health", timeout=5).status_code)
                if codes[-1] == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
