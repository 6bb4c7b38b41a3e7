"""echo=True with max_tokens=0 on /v1/completions: the prompt alone with its logprobs (OpenAI's
way to score a text, which scoring clients such as lm-evaluation-harness send; vLLM serves it),
the same as the prompt part of max_tokens=1, streamed and not; max_tokens=0 without echo (and
on the chat route) stays a 400 naming max_tokens."""

from __future__ import annotations

from tests.serve.conftest import MODEL, _err, _ok, _sse

PROMPT = "The quick brown fox jumps over the lazy dog"


def _body(**kw):
    return {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "temperature": 0, **kw}


def test_echo_with_max_tokens_0_is_the_prompt_part_of_max_tokens_1(server):
    only = _ok(server.post("/v1/completions", _body(max_tokens=0)))
    one = _ok(server.post("/v1/completions", _body(max_tokens=1)))
    c, d = only["choices"][0], one["choices"][0]
    n = only["usage"]["prompt_tokens"]
    assert c["text"] == PROMPT and d["text"].startswith(PROMPT) and len(d["text"]) > len(PROMPT)
    assert c["finish_reason"] == "length"
    lp, full = c["logprobs"], d["logprobs"]
    assert len(lp["tokens"]) == n and lp["token_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert lp[key] == full[key][:n], key
    assert len(full["tokens"]) == n + 1


def test_echo_with_max_tokens_0_streamed(server):
    only = _ok(server.post("/v1/completions", _body(max_tokens=0)))["choices"][0]
    chunks = [c["choices"][0] for c in _sse(server, "/v1/completions", _body(max_tokens=0, stream=True))]
    assert "".join(c["text"] for c in chunks) == PROMPT
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == only["logprobs"]["tokens"]
    assert [c["finish_reason"] for c in chunks][-1] == "length"


def test_max_tokens_0_without_echo_is_refused(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}
    assert "max_tokens" in _err(server.post("/v1/completions", body), "max_tokens")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0,
            "echo": True}
    assert "max_tokens" in _err(server.post("/v1/chat/completions", chat), "max_tokens")


def test_echo_only_refusals_say_why(server):
    err = _err(server.post("/v1/completions", _body(max_tokens=0, min_tokens=2)), "min_tokens")
    assert "echo" in err and "max_tokens=0" in err
    long = {"model": MODEL, "prompt": [5] * 1024, "echo": True, "max_tokens": 0}  # max_model_len
    assert "max_model_len - 1" in _err(server.post("/v1/completions", long), "prompt")
