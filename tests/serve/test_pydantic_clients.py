"""What clients that build schemas from pydantic models send (instructor's TOOLS and JSON_SCHEMA
modes, the openai client's parse helpers): the model's JSON schema as a named tool's
parameters, or as response_format json_schema without strict; and instructor itself (a dev
extra) in both modes, one attempt per prompt. Pydantic leaves
additionalProperties unset; on a default server (vLLM's default: such objects closed) every
answer of a recorded prompt set validates against the model, nested models, enums, optional
fields and lists of models included (with objects left open, 1 of 5 did in each mode,
2026-12-04: the model adds keys until max_tokens). A list without maxItems is not bounded by
the grammar (a number's digits are: jaxkv/structured_outputs/json_schema.py): the Order says
max_length, as pydantic users write it."""

from __future__ import annotations

import json
from enum import Enum

import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import API_KEY, MODEL


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    favourite_colour: Colour
    address: Address
    nickname: str | None = None


class Item(BaseModel):
    title: str
    quantity: int


class Order(BaseModel):
    customer: str
    items: list[Item] = Field(max_length=4)  # a list with no bound runs on as numbers do


PROMPTS = [(Person, "Extract the person: Ada Lovelace, 36, loves blue, lives in London, England."),
           (Person, "Invent a person who lives in Paris."),
           (Order, "Bob ordered two apples and three pears."),
           (Order, "Make up a small grocery order."),
           (Address, "Where is the Eiffel Tower?")]


def _tools_mode(client, model, prompt):
    tool = {"type": "function", "function": {"name": model.__name__, "description": f"Correctly "
            f"extracted `{model.__name__}` with all the required parameters with correct types",
            "parameters": model.model_json_schema()}}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=160,
        tools=[tool], tool_choice={"type": "function", "function": {"name": model.__name__}})
    return r.choices[0].message.tool_calls[0].function.arguments


def _json_schema_mode(client, model, prompt):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": model.__name__,
                                                                "schema": model.model_json_schema()}})
    return r.choices[0].message.content


@pytest.mark.parametrize("mode", [_tools_mode, _json_schema_mode], ids=["tools", "json_schema"])
def test_every_answer_validates(client, mode):
    for model, prompt in PROMPTS:
        text = mode(client, model, prompt)
        model.model_validate_json(text)  # raises on any extra key, missing field or bad type
        assert set(json.loads(text)) <= set(model.model_fields)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_gets_every_answer_validated_first_time(server, mode):
    """instructor 1.17 on a default server: each prompt's one attempt (max_retries=0; the
    requests are counted) parses into its model."""
    import httpx
    import instructor
    from openai import OpenAI

    posts = []
    http = httpx.Client(event_hooks={"request": [lambda r: posts.append(r.url.path)]}, timeout=120)
    client = instructor.from_openai(OpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                           max_retries=0, http_client=http),
                                    mode=getattr(instructor.Mode, mode))
    for model, prompt in PROMPTS:
        got = client.chat.completions.create(
            model=MODEL, response_model=model, max_retries=0, temperature=0, max_tokens=160,
            messages=[{"role": "user", "content": prompt}])
        assert isinstance(got, model)
    assert posts == ["/v1/chat/completions"] * len(PROMPTS)
