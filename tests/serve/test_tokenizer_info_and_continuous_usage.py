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


def _check_continuous(chunks, prompt_tokens: dict):
    """vLLM's continuous usage: each chunk carries its own choice's usage (the prompt of its
    request, the tokens that choice generated so far); the last chunk sums every choice."""
    *body, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    per_choice: dict[int, list[int]] = {}
    for c in body:
        (ch,) = c["choices"]
        u = c["usage"]
        assert u["prompt_tokens"] == prompt_tokens[ch["index"]]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        per_choice.setdefault(ch["index"], []).append(u["completion_tokens"])
    for done in per_choice.values():
        assert done == sorted(done)
    assert sum(done[-1] for done in per_choice.values()) == last["usage"]["completion_tokens"]
    return per_choice


def test_continuous_usage_stats_in_every_chunk(server, tok):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 8, "temperature": 0.8, "seed": 1, "n": 2, "stream": True,
            "stream_options": opts}
    chunks = _sse(server, "/v1/chat/completions", chat)
    n_prompt = chunks[-1]["usage"]["prompt_tokens"]
    per_choice = _check_continuous(chunks, {0: n_prompt, 1: n_prompt})
    assert all(done[0] == 0 for done in per_choice.values())  # the role chunk: nothing yet
    prompts = ["One, two,", "The sky is blue and the grass is"]
    comp = {"model": MODEL, "prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2,
            "stream": True, "stream_options": opts}
    lengths = [len(tok.encode(p)) for p in prompts]
    _check_continuous(_sse(server, "/v1/completions", comp),
                      {i * 2 + j: lengths[i] for i in range(2) for j in range(2)})
    plain = _sse(server, "/v1/completions", {**comp, "stream_options": {"include_usage": True}})
    assert all(c.get("usage") is None for c in plain[:-1]) and plain[-1]["usage"] is not None
