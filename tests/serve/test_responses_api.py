"""The Responses API (/v1/responses) through the official openai client, against the real
server (started with --enable-responses-api-store): text with instructions equal to the chat
route's answer to the same messages, a json_schema text format, a function tool called and
its result fed back, previous_response_id and GET /v1/responses/{id}, the typed stream, and
4xx bodies naming the Responses field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient

from tests.serve.conftest import MODEL, _err

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def test_text_with_instructions_is_the_chat_answer(client):
    r = client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                input="What is the capital of France?", max_output_tokens=24,
                                temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in one short sentence."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=3,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Invent a person.", max_output_tokens=64,
                                temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_function_tool_call_and_its_result_fed_back(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=24, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temperature_c": 21, "sky": "clear"}'}])
    assert follow.output_text and follow.output[0].type == "message"


def test_previous_response_id_and_get(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.",
                                    max_output_tokens=12, temperature=0, store=True)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    second = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=12,
                                     temperature=0, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=12,
                                    temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens  # the first turn is in its prompt


def test_stream_events_and_final_response(client):
    kw = dict(model=MODEL, input="Name three colours.", max_output_tokens=16, temperature=0)
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == plain.output_text
    for k in ("response.output_item.added", "response.content_part.added",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kinds.count(k) == 1, k
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_streamed_function_call(client):
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=48, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = [o for o in final.output if o.type == "function_call"][0]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and json.loads(args)["city"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
])
def test_bad_requests_name_the_field(server, body, param):
    assert _err(server.post("/v1/responses", {"model": MODEL, **body}), param)


def test_unknown_ids_are_404(server):
    r = server.post("/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    g = httpx.get(server.url + "/v1/responses/resp_nope", headers=server.headers, timeout=30)
    assert g.status_code == 404
    assert "/v1/responses" in httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]


def test_without_the_store_previous_response_id_is_refused():
    from serve.app import build_app
    from serve.context import ServerContext

    class Ready:  # an engine that is up (the request is refused before it is used)
        dead = None

    app = build_app(ServerContext(model_name=MODEL, engine=Ready()), metrics=None)
    r = TestClient(app).post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "--enable-responses-api-store" in r.json()["error"]["message"]
    assert TestClient(app).get("/v1/responses/resp_x").status_code == 404
