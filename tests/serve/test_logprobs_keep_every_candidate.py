"""Completions and chat logprobs keep every candidate, byte fragments shown as `bytes:\\xNN`, and
completions text_offset counts characters as the text does (handed case C6 of 2026-11-30)."""

from __future__ import annotations

import codecs
import re

import pytest

from tests.serve.conftest import MODEL, _ok, _sse

JA_PROMPT = "日本語のテキスト: 東京は日本の首都です。大阪は"
FRAGMENT = re.compile(r"^bytes:(\\x[0-9a-f]{2})+$")


def _utf8(data: bytes) -> str:
    """The text of these bytes, less a character cut at the end (held back, as the text is)."""
    return codecs.getincrementaldecoder("utf-8")().decode(data)


def _shown_bytes(token: str) -> bytes:
    if token.startswith("bytes:"):
        assert FRAGMENT.match(token), token
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
    return token.encode()


@pytest.mark.parametrize("prompt,k,extra", [
    (JA_PROMPT, 20, {}),  # the case's input
    ("中文测试：北京是中国的首都。上海是", 20, {"echo": True}),
    (JA_PROMPT, 2, {"temperature": 2.0, "seed": 3, "max_tokens": 16}),
])
def test_completion_logprobs_keep_every_candidate(server, prompt, k, extra):
    body = {"model": MODEL, "prompt": prompt, "logprobs": k, "max_tokens": 8, "temperature": 0, **extra}
    r = _ok(server.post("/v1/completions", body))
    c, lp, greedy = r["choices"][0], r["choices"][0]["logprobs"], body["temperature"] == 0
    n_gen, start = r["usage"]["completion_tokens"], 1 if extra.get("echo") else 0  # echo: 1st has none
    rows = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]))
    assert {len(v) for v in lp.values()} == {n_gen + (r["usage"]["prompt_tokens"] if start else 0)}
    for j, (tok_, val, top, _) in enumerate(rows[start:], start):
        assert len(top) in (k, k + 1), (tok_, top)  # k candidates (+ the chosen one when outside)
        assert top[tok_] == val
        assert all(not t.startswith("bytes:") or FRAGMENT.match(t) for t in top)
        if greedy and j >= len(rows) - n_gen:
            assert val == max(top.values())
    assert any(t.startswith("bytes:") for t in lp["tokens"])
    if c["finish_reason"] == "length" and greedy:  # no EOS: the tokens' bytes make the text
        assert _utf8(b"".join(_shown_bytes(t) for t in lp["tokens"])) == c["text"]
    # text_offset: where each token's text starts in the text (a fragment: the character it is in)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for t, _, _, o in rows if c["finish_reason"] == "length" else []:
        assert t.startswith("bytes:") or c["text"][o:o + len(t)] == t, (t, o, c["text"])


def test_stream_logprobs_match_non_stream(server):
    body = {"model": MODEL, "prompt": JA_PROMPT, "logprobs": 20, "max_tokens": 8, "temperature": 0}
    lp = _ok(server.post("/v1/completions", body))["choices"][0]["logprobs"]
    chunks = _sse(server, "/v1/completions", {**body, "stream": True})
    got = {key: [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"][key]]
           for key in lp}
    assert got == lp


@pytest.mark.parametrize("content", ["日本の首都はどこですか？日本語で答えてください。",
                                     "Translate 'cat' into Chinese characters only."])
def test_chat_top_logprobs_and_bytes(server, content):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "logprobs": True,
            "top_logprobs": 20, "max_tokens": 8, "temperature": 0}
    r = _ok(server.post("/v1/chat/completions", body))
    items = r["choices"][0]["logprobs"]["content"]
    assert len(items) == r["usage"]["completion_tokens"]
    for it in items:
        assert len(it["top_logprobs"]) == 20
        assert len({bytes(x["bytes"]) for x in it["top_logprobs"]}) == 20  # distinct candidates
        assert it["logprob"] == it["top_logprobs"][0]["logprob"]  # greedy: the top one
        for x in [it, *it["top_logprobs"]]:
            assert bytes(x["bytes"]) == _shown_bytes(x["token"])
    if r["choices"][0]["finish_reason"] == "length":
        assert _utf8(bytes(b for it in items for b in it["bytes"])) == r["choices"][0]["message"]["content"]
