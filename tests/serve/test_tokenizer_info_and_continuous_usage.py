"""Two vLLM habits load testers and eval harnesses rely on: GET /tokenizer_info behind
--enable-tokenizer-info-endpoint (the EOS token and chat template lm-evaluation-harness reads;
a 404 without the flag), and stream_options.continuous_usage_stats (usage in every chunk)."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from serve.app import build_app
from serve.context import ServerContext
from tests.serve.conftest import MODEL, _sse


def test_tokenizer_info_is_off_without_the_flag():
    app = build_app(ServerContext(model_name=MODEL), metrics=None)
    assert TestClient(app).get("/tokenizer_info").status_code == 404
    paths = TestClient(app).get("/openapi.json").json()["paths"]
    assert "/tokenizer_info" not in paths and "/tokenize" in paths


def test_tokenizer_info_gives_the_tokenizer_config(server, tok):
    r = httpx.get(server.url + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == tok.eos_token == "<|im_end|>"
    assert info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert info["model_max_length"] == tok.model_max_length
    assert "/tokenizer_info" in httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]


def _check_continuous(chunks):
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    seen = [c["usage"] for c in body]
    assert all(u is not None for u in seen)
    assert all(u["prompt_tokens"] == last["usage"]["prompt_tokens"] for u in seen)
    done = [u["completion_tokens"] for u in seen]
    assert done == sorted(done) and done[-1] == last["usage"]["completion_tokens"]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in seen)


def test_continuous_usage_stats_in_every_chunk(server):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": opts}
    _check_continuous(_sse(server, "/v1/chat/completions", chat))
    comp = {"model": MODEL, "prompt": "One, two,", "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": opts}
    _check_continuous(_sse(server, "/v1/completions", comp))
    plain = _sse(server, "/v1/completions", {**comp, "stream_options": {"include_usage": True}})
    assert all(c.get("usage") is None for c in plain[:-1]) and plain[-1]["usage"] is not None
