"""The OpenAI routes through the official `openai` client and raw SSE, against the real server."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx

from tests.serve.conftest import API_KEY, MODEL


def _sse(server, path, body) -> list:
    """The data: payloads of a streamed response, parsed; the last one must be [DONE]."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line[6:])
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def test_health_was_503_during_warmup_then_200(server):
    assert 503 in server.health_codes and server.health_codes[-1] == 200
    assert server.health_codes.index(503) < server.health_codes.index(200)
    assert "KV cache:" in server.log() and "maximum concurrency" in server.log()


def test_models_and_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 1024
    assert httpx.get(server.url + "/version").json()["version"]


def test_seed_article_client_example(client):
    # 004_*.txt section 3, with only base_url and the model name changed; the reply is Chinese,
    # so it also crosses multi-byte characters.
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "你是一个有用的助手。"},
                               {"role": "user", "content": "用一句话解释大模型推理加速。"}],
        temperature=0.7, max_tokens=512)
    text = response.choices[0].message.content
    assert text and "\ufffd" not in text
    assert response.choices[0].finish_reason in ("stop", "length")
    u = response.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0


def test_chat_greedy_answer_and_usage_match_tokenize(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    n_prompt = server.post("/tokenize", {"messages": messages}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    # completion_tokens counts the EOS token that ended it, as vLLM
    n_text = server.post("/tokenize", {"prompt": r.choices[0].message.content,
                                       "add_special_tokens": False}).json()["count"]
    assert r.usage.completion_tokens == n_text + 1


def test_chat_stream_equals_non_stream_with_one_finish_reason_per_choice(server, client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three fruits."}],
            "temperature": 0, "max_tokens": 30, "n": 2}
    full = client.chat.completions.create(**body)
    chunks = _sse(server, "/v1/chat/completions",
                  {**body, "stream": True, "stream_options": {"include_usage": True}})
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    for idx in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == idx]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum(c["finish_reason"] is not None for c in mine) == 1 and mine[-1]["finish_reason"]
        text = "".join(c["delta"].get("content") or "" for c in mine)
        assert text == full.choices[idx].message.content
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)


def test_completions_n_and_multiple_prompts_index_choices(client):
    r = client.completions.create(model=MODEL, prompt=["The sky is", "Water is"], n=2,
                                  max_tokens=5, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 20
    ids = client.completions.create(model=MODEL, prompt=[[504, 3100, 314], [504, 3100]],
                                    max_tokens=3, temperature=0)
    assert sorted(c.index for c in ids.choices) == [0, 1] and ids.usage.prompt_tokens == 5
    same_seed = client.completions.create(model=MODEL, prompt="The sky is", n=2, max_tokens=5,
                                          temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.text for c in same_seed.choices] == [c.text for c in r.choices if c.index < 2]


def test_completions_stream_n2_two_prompts_logprobs(server):
    body = {"model": MODEL, "prompt": ["The sky is", "Water is"], "n": 2, "max_tokens": 6,
            "temperature": 0.9, "seed": 5, "logprobs": 1, "stream": True, "ignore_eos": True}
    chunks = _sse(server, "/v1/completions", body)
    for idx in range(4):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == idx]
        assert sum(c["finish_reason"] is not None for c in mine) == 1 and mine[-1]["finish_reason"] == "length"
        assert mine[-1]["logprobs"] is None and mine[-1]["text"] == ""  # the finish chunk: no token
        offsets = [o for c in mine[:-1] for o in c["logprobs"]["text_offset"]]
        tokens = [t for c in mine[:-1] for t in c["logprobs"]["tokens"]]
        assert len(tokens) == 6
        assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(6)]  # carried across chunks
        assert "".join(tokens) == "".join(c["text"] for c in mine)


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and top[tok] == val and len(top) <= 4
        assert val == max(top.values())  # greedy picks the most likely token
    e = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logprobs=1, echo=True)
    c = e.choices[0]
    assert c.text.startswith("The capital of France is")
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.tokens[0] == "The"
    assert len(c.logprobs.tokens) == e.usage.prompt_tokens + e.usage.completion_tokens
    assert c.logprobs.text_offset[:2] == [0, 3]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                       temperature=0, max_tokens=5, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == item.top_logprobs[0].logprob
        assert item.bytes == list(item.token.encode())


def test_cached_tokens_on_the_second_send_of_a_long_prompt(client):
    prompt = f"[{uuid.uuid4().hex}] " + "A paged KV cache stores keys and values in blocks. " * 12
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and n - 16 <= cached < n


def test_stop_string_never_leaks_into_streamed_text(server):
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3, 4, 5, 6,", "max_tokens": 40,
            "temperature": 0, "stop": [" 9"], "stream": True}
    chunks = _sse(server, "/v1/completions", body)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    finals = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["finish_reason"] == "stop" and finals[0]["stop_reason"] == " 9"
    assert " 9" not in text and text.rstrip(",").endswith("8")


def test_32_concurrent_requests_all_succeed(server):
    from openai import AsyncOpenAI

    async def run():
        c = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        rs = await asyncio.gather(*(c.completions.create(
            model=MODEL, prompt=f"Fact number {i}:", max_tokens=8, temperature=0.8, seed=i,
            extra_body={"ignore_eos": True}) for i in range(32)))
        await c.close()
        return rs

    rs = asyncio.run(run())
    assert len(rs) == 32
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8 for r in rs)


def test_tokenize_detokenize_round_trip(server):
    t = server.post("/tokenize", {"prompt": "Hello world, 你好"}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 1024
    assert server.post("/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == "Hello world, 你好"
