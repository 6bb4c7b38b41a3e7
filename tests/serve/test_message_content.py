"""Null or non-text chat message content is a 400 naming the field (except an assistant message
with tool_calls), and the server keeps serving (handed case C8 of 2026-11-30)."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL, _err, _ok


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": None}], "messages[0].content"),  # the case's input
    ([{"role": "system", "content": None}, {"role": "user", "content": "Hi"}], "messages[0].content"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages[0].content[0]"),
])
def test_bad_content_is_400_naming_the_field(server, messages, param):
    for route in ("/v1/chat/completions", "/tokenize"):
        msg = _err(server.post(route, {"model": MODEL, "messages": messages, "max_tokens": 1}), param)
        assert param in msg
    ok = _ok(server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "Hi"}]}))
    assert ok["usage"]["completion_tokens"] >= 1 and ok["choices"][0]["message"]["content"] is not None


def test_null_content_with_tool_calls_is_served(server):
    """The exception the case names: an assistant message with tool_calls may have null
    content (tool calling, issue 15), followed by the tool's result."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"}]
    ok = _ok(server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": messages}))
    assert ok["usage"]["completion_tokens"] >= 1
