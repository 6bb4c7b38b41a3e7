"""Streamed chat and completions: content chunks have finish_reason null, the finish comes alone
with an empty delta/text, then usage if asked, then [DONE] (handed case C5 of 2026-11-30)."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL, _ok, _sse


def _check_order(chunks, chat: bool, usage: bool) -> dict[int, str]:
    """Per choice: content chunks with finish_reason null, then exactly one finish chunk with
    no content, last for that choice; usage (if asked) in its own chunk at the very end."""
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
        chunks = chunks[:-1]
    assert all(c["choices"] and "usage" not in c for c in chunks)
    texts: dict[int, str] = {}
    for idx in sorted({c["choices"][0]["index"] for c in chunks}):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        *body, last = mine
        assert last["finish_reason"] in ("stop", "length")
        assert (last["delta"] == {} if chat else last["text"] == "") and last["logprobs"] is None
        assert all(c["finish_reason"] is None for c in body)
        if chat:
            assert body[0]["delta"] == {"role": "assistant", "content": ""}
        texts[idx] = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in body)
    return texts


STORY_CHAT = {"messages": [{"role": "user", "content": "Write a long story about a brave cat."}]}
STORY, COUNT = {"prompt": "Once upon a time, a brave cat"}, "Count: 1, 2, 3, 4, 5, 6,"
N2 = {"n": 2, "temperature": 0.8, "seed": 7, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("route,extra", [
    ("/v1/chat/completions", STORY_CHAT),  # the case's input
    ("/v1/chat/completions", {**STORY_CHAT, **N2}),
    ("/v1/chat/completions", {**STORY_CHAT, "stop": [" a"], "max_tokens": 20}),
    ("/v1/completions", STORY),
    ("/v1/completions", {**STORY, **N2}),
    ("/v1/completions", {"prompt": [COUNT, COUNT + " 7,"], "stop": [" 9"], "max_tokens": 30}),
    ("/v1/completions", {**STORY, "logprobs": 2, "echo": True}),
])
def test_stream_finish_chunk_is_alone(server, route, extra):
    chat, body = "chat" in route, {"model": MODEL, "max_tokens": 6, "temperature": 0, **extra}
    full = _ok(server.post(route, {k: v for k, v in body.items() if k != "stream_options"}))
    texts = _check_order(_sse(server, route, {**body, "stream": True}), chat, "stream_options" in body)
    assert texts == {c["index"]: c["message"]["content"] if chat else c["text"] for c in full["choices"]}
    n_prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert len(texts) == body.get("n", 1) * n_prompts and all(texts.values())
    if "stop" in body:
        assert all((c["finish_reason"], c["stop_reason"]) == ("stop", body["stop"][0]) for c in full["choices"])
