"""The Responses API's request (POST /v1/responses) and the shape of its response, as OpenAI's
reference and vLLM's `ResponsesRequest` spell them.

jaxkv serves the text part of the API: `input` as a string or as message, function_call and
function_call_output items; `instructions`; `max_output_tokens`; the sampling fields (and
vLLM's extras: top_k, min_p, seed, repetition_penalty, ...); `text.format` (text, json_object,
json_schema); function `tools` with `tool_choice`; `stream`; logprobs through
`include=["message.output_text.logprobs"]` and `top_logprobs`; `store` and
`previous_response_id` with the response store on (serve/response_store.py). Built-in tools
(web search, file search, ...), images and files, and background mode are refused with a 400
naming the field. serve/responses.py turns a request into a chat completion and its result
into a Response.
"""

from __future__ import annotations

import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from serve.protocol import Number, _Base

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ToolChoiceFunction(_Base):
    type: Literal["function"] = "function"
    name: StrictStr


class TextFormat(_Base):
    """text.format: plain text, any JSON object, or a JSON schema (name and schema beside the
    type, not nested as in chat's response_format)."""
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Base):
    format: TextFormat | None = None


class ResponsesRequest(_Base):
    """POST /v1/responses. Fields the chat route shares (top_k, seed, stop, logit_bias, ...)
    pass through to it unchanged; `input` items are checked in serve/responses.py, whose
    errors name them (input[2].content[0].type)."""
    model: str | None = None
    input: Union[StrictStr, list[dict]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: StrictBool = False
    text: TextConfig | None = None
    tools: list[dict] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ToolChoiceFunction, None] = None
    parallel_tool_calls: StrictBool | None = True
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: StrictBool | None = None
    reasoning: dict | None = None


class ResponseObject(BaseModel):
    """What POST /v1/responses answers (and GET /v1/responses/{id}, and the `response` of
    the stream's response.created / response.completed events), for /openapi.json."""
    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress"]
    incomplete_details: dict | None = None
    output: list[dict]
    usage: dict | None = None
    error: dict | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str, logprobs: list | None, item_id: str | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant", "content": [part]}


def function_call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


def responses_logprobs(content) -> list[dict]:
    """Chat logprob entries (dicts) as the Responses API's: token, logprob, bytes, top_logprobs."""
    return [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                              for t in e["top_logprobs"]]} for e in content or []]


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """A reasoning item (--reasoning-parser): the <think> block's text as reasoning_text."""
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}
