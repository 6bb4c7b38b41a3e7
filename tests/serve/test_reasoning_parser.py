"""--reasoning-parser (vLLM's qwen3 and deepseek_r1): the <think> block apart from the answer.
The splitter gives a stream's pieces that join to the whole text's split wherever the text is
cut; the server (started with --reasoning-parser qwen3) returns reasoning_content apart from
content, streamed and not, and a reasoning item in the Responses API, for an output whose
think block a regex constraint forces; and so does a server of a tiny random Qwen3 model
(Qwen3ForCausalLM: q/k norms, a config as transformers writes it), as a thinking model
serves."""

from __future__ import annotations

import pytest

from serve.reasoning_parsers import ReasoningSplitter, split
from tests.helpers import write_tiny_model
from tests.serve.conftest import MODEL, _ok, _sse, launched

TEXTS = ["<think>abc</think>Hello", "Hi <think>x</think>y", "no tags", "<think>unfinished",
         "abc</think>ans", "<thi", "<think></think>", "a</thi", "<think>a</think>b</think>c"]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_stream_pieces_join_to_the_whole_split(parser):
    for text in TEXTS:
        whole = split(parser, text)
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                s = ReasoningSplitter(parser)
                parts = [s.feed(text[:i]), s.feed(text[i:j]), s.feed(text[j:]), s.flush()]
                got = ("".join(p[0] for p in parts) or None, "".join(p[1] for p in parts) or None)
                assert got == whole, (parser, text, i, j)


def test_the_parsers_split_as_vllms():
    assert split("qwen3", "<think>abc</think>Hello") == ("abc", "Hello")
    assert split("qwen3", "no tags") == (None, "no tags")  # thinking off: all content
    assert split("deepseek_r1", "abc</think>ans") == ("abc", "ans")  # opened by the template
    assert split("deepseek_r1", "still thinking") == ("still thinking", None)
    assert split("deepseek_r1", "{\"a\": 1}", constrained=True) == (None, "{\"a\": 1}")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningSplitter("granite")


THINK = {"structured_outputs": {"regex": "<think>[a-z]{3,8}</think>[A-Z][a-z]{2,8}"}}


def _body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
            "temperature": 0, "max_tokens": 32, **THINK, **kw}


def test_chat_reasoning_content_streamed_and_not(server):
    msg = _ok(server.post("/v1/chat/completions", _body()))["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["reasoning_content"].isalpha()
    assert msg["content"][0].isupper() and "<think>" not in msg["content"]
    chunks = _sse(server, "/v1/chat/completions", _body(stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    plain = _ok(server.post("/v1/chat/completions", {**_body(), "structured_outputs": None,
                                                     "max_tokens": 4}))["choices"][0]["message"]
    assert "reasoning_content" not in plain  # no think block: no field


def test_responses_reasoning_item(client):
    r = client.responses.create(model=MODEL, input="Think, then answer.", max_output_tokens=32,
                                temperature=0, extra_body=THINK)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought.isalpha() and r.output_text[0].isupper()
    with client.responses.stream(model=MODEL, input="Think, then answer.", max_output_tokens=32,
                                 temperature=0, extra_body=THINK) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=49152,
             hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
             rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("qwen3"), QWEN3)
    yield from launched(("--model", folder, "--load-format", "dummy", "--served-model-name", MODEL))


def test_a_tiny_qwen3_model_thinks_apart_from_its_answer(qwen3_server):
    assert "Qwen3ForCausalLM" in qwen3_server.log()
    msg = _ok(qwen3_server.post("/v1/chat/completions", _body()))["choices"][0]["message"]
    assert msg["reasoning_content"].isalpha() and 3 <= len(msg["reasoning_content"]) <= 8
    assert msg["content"][0].isupper() and msg["content"].isalpha()
    chunks = _sse(qwen3_server, "/v1/chat/completions", _body(stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
