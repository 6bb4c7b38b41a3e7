"""tool_choice "auto" with the hermes parser: the parser on fixed texts (whole and streamed in
every split), and a server (--enable-auto-tool-choice --tool-call-parser hermes) on a small
random-weight Qwen2-shaped model folder whose chat template renders the tools, driven by the
official openai client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from serve.tool_parsers import HermesStream, extract_tool_calls
from tests.serve.conftest import _free_port, join_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
PARIS = ("get_weather", '{"city": "Paris", "unit": "celsius"}')
TZ = ("get_time", '{"timezone": "Europe/Paris"}')


@pytest.mark.parametrize("text,content,calls", [
    ("Hello there", "Hello there", []),
    (CALL, None, [PARIS]),
    ("Let me check. " + CALL, "Let me check. ", [PARIS]),
    (TWO, None, [PARIS, TZ]),
    ('<tool_call>{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}', None, [TZ]),  # unclosed
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("a < b and <tool", "a < b and <tool", []),
])
def test_hermes_parser_whole_and_streamed(text, content, calls):
    assert extract_tool_calls(text) == (content, calls)
    for step in (1, 2, 3, 7, len(text)):  # deltas of every size
        s, got_content, got_calls = HermesStream(), "", []
        for i in range(0, len(text), step):
            c, k = s.feed(text[i:i + step])
            got_content += c
            got_calls += k
        c, k = s.end()
        got_content += c
        got_calls += k
        assert got_calls == calls, step
        if calls:
            assert got_content == (content or ""), step
        else:  # nothing parsed: every character of the text comes out as content
            assert got_content == text, step


TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call functions. Signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=49152,
             hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
             rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """`jaxkv serve` of a random-weight Qwen2-shaped folder: SmolLM2's tokenizer and a template
    that renders tools and tool calls. (Qwen2.5 adds <tool_call> as a token of its own;
    llguidance counts every added token as special, so a grammar could not spell it as text:
    here the tags are ordinary text, which the choice constraint below can write.)"""
    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf

    path = tmp_path_factory.mktemp("qwen2_tools")
    (path / "config.json").write_text(json.dumps(QWEN2))
    tok = tokenizer_from_gguf(embedded_model_path())
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(path)
    port = _free_port()
    log = open(path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxkv.cli", "serve", str(path), "--port", str(port),
         "--load-format", "dummy", "--served-model-name", "x", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
         "--token-buckets", "8,64", "--kv-cache-memory-bytes", str(4 << 20)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the Qwen2-shaped server did not start:\n" + (path / "serve.log").read_text())
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"timezone": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


def test_auto_tool_choice_renders_tools_and_parses_calls(qwen_server):
    from openai import OpenAI

    client = OpenAI(base_url=qwen_server + "/v1", api_key="x", max_retries=0, timeout=120)
    plain = client.chat.completions.create(model="x", messages=ASK, max_tokens=4, temperature=0)
    free = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, max_tokens=8,
                                          temperature=0)  # tool_choice defaults to auto
    assert free.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tools are in the prompt
    assert free.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Random weights never call a tool by themselves: a choice constraint makes this model
    # write a known text, which the hermes parser must then read.
    for text, content in (("Let me check." + TWO, "Let me check."), (TWO, None)):
        for stream in (False, True):
            r = client.chat.completions.create(model="x", messages=ASK, tools=TOOLS, tool_choice="auto",
                                               temperature=0, max_tokens=120, stream=stream,
                                               extra_body={"structured_outputs": {"choice": [text]}})
            got_content, calls, finish = join_tool_calls(r, stream)
            assert finish == "tool_calls", (got_content, calls, stream)
            assert (got_content or None) == content
            assert [(c["name"], c["arguments"]) for c in calls] == [PARIS, TZ]
            assert all(c["id"].startswith("chatcmpl-tool-") for c in calls)
    # The calls and their results go back into the conversation.
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": PARIS[0], "arguments": PARIS[1]}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    r = client.chat.completions.create(model="x", messages=follow, tools=TOOLS, max_tokens=4,
                                       temperature=0)
    assert r.usage.prompt_tokens > free.usage.prompt_tokens

