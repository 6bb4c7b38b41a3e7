"""vLLM request fields that change a request's meaning (continue_final_message, echo,
add_generation_prompt, chat_template_kwargs, ...) are honoured or refused with a 400 naming the
field, never silently ignored (handed case C7 of 2026-11-30)."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL, _err, _ok, _sse


PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]
CONT = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.mark.parametrize("messages,n_prompt", [
    (PREFILL, 42),  # the case's input
    ([{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}], None),
])
def test_continue_final_message_leaves_the_turn_open(server, tok, messages, n_prompt):
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **CONT}
    r = _ok(server.post("/v1/chat/completions", body))
    t = _ok(server.post("/tokenize", {"messages": messages, **CONT}))
    want = tok.encode(tok.apply_chat_template(messages, tokenize=False, **CONT), add_special_tokens=False)
    assert r["usage"]["prompt_tokens"] == t["count"] == len(want) == (n_prompt or len(want))
    assert t["tokens"] == want and want[-1] != 198 and 2 not in want[-3:]  # not closed by <|im_end|>\n
    assert r["choices"][0]["message"]["content"]  # it continued (was empty)
    closed = _ok(server.post("/tokenize", {"messages": messages, "add_generation_prompt": False}))
    assert closed["count"] == t["count"] + 2


def test_echo_and_flag_conflict(server):
    body = {"model": MODEL, "messages": PREFILL, "max_tokens": 8, "temperature": 0, **CONT}
    plain = _ok(server.post("/v1/chat/completions", body))["choices"][0]["message"]["content"]
    echoed = _ok(server.post("/v1/chat/completions", {**body, "echo": True}))["choices"][0]["message"]["content"]
    assert echoed == "The capital of France is" + plain
    chunks = _sse(server, "/v1/chat/completions", {**body, "echo": True, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == echoed
    for route in ("/v1/chat/completions", "/tokenize"):
        both = {**body, "add_generation_prompt": True}
        assert "continue_final_message" in _err(server.post(route, both), "continue_final_message")


def test_add_generation_prompt_and_chat_template_kwargs(server, tok):
    msgs = [{"role": "user", "content": "Hi"}]
    with_prompt = _ok(server.post("/tokenize", {"messages": msgs}))["count"]
    r = _ok(server.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1,
                                                 "add_generation_prompt": False}))
    assert r["usage"]["prompt_tokens"] == with_prompt - len(tok.encode("<|im_start|>assistant\n"))
    kw = _ok(server.post("/tokenize", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}))
    assert kw["count"] == with_prompt  # passed to the template (which has no use for it)
    for route in ("/tokenize", "/v1/chat/completions"):
        bad = {"model": MODEL, "messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}}
        _err(server.post(route, bad), "chat_template_kwargs")


@pytest.mark.parametrize("route,field,value", [
    # (tools, response_format and guided_* were here until issue 15 implemented them:
    # tests/serve/test_structured_outputs.py)
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "cache_salt", "tenant-1"),
    ("/v1/chat/completions", "chat_template", "{{ messages[0]['content'] }}"),
    ("/v1/chat/completions", "prompt_logprobs", 1),
    ("/v1/chat/completions", "add_special_tokens", True),
    ("/v1/completions", "logits_processors", ["my_module.MyProcessor"]),
])
def test_meaning_changing_fields_are_refused(server, route, field, value):
    body = ({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"})
    assert field in _err(server.post(route, {"model": MODEL, **body, "max_tokens": 1, field: value}), field)


@pytest.mark.parametrize("extra", [{"user": "u-1"}, {"metadata": {"k": "v"}}, {"tools": []},
                                   {"response_format": {"type": "text"}}, {"add_special_tokens": False}])
def test_harmless_fields_still_served(server, extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    assert _ok(server.post("/v1/chat/completions", body))["usage"]["completion_tokens"] == 1
