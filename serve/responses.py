"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API, as vLLM serves it.

A Responses request is served as one chat completion: `instructions` become the system
message, the stored conversation of `previous_response_id` follows, then `input` (a string is
one user message; message items, function_call items (an assistant turn's tool calls) and
function_call_output items (tool messages)). `text.format` becomes response_format,
function tools and tool_choice the chat route's (serve/tools.py), `max_output_tokens`
max_tokens. The chat route checks and renders it; its result becomes the Response's output
items: a message with one output_text part, then one function_call item per tool call.
Status "incomplete" (incomplete_details.reason "max_output_tokens") when the length ran out.
Errors are the chat route's, naming the Responses field (max_tokens -> max_output_tokens,
messages -> input, response_format -> text.format). Streams: serve/responses_stream.py.
"""

from __future__ import annotations

import time

from pydantic import ValidationError

from serve.chat import prepare_chat
from serve.context import ServerContext
from serve.errors import APIError
from serve.protocol import ChatCompletionRequest
from serve.responses_protocol import (LOGPROBS_INCLUDE, ResponsesRequest, function_call_item,
                                      message_item, new_id, reasoning_item, responses_logprobs)
from serve.responses_stream import response_events
from serve.streams import SSEResponse, collect_or_abort

# chat field -> the Responses field a client sent
FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "messages": "input", "response_format": "text.format", "logprobs": "include"}


async def create_response(req: ResponsesRequest, ctx: ServerContext, raw):
    run = start(req, ctx)
    if req.stream:
        return SSEResponse(response_events(run))
    chat = await collect_or_abort(raw, run.chat.batch, run.chat.collect())
    if chat is None:  # the client left
        return None
    return run.finish(chat_output_items(chat["choices"][0]), chat["choices"][0]["finish_reason"],
                      chat["usage"])


def start(req: ResponsesRequest, ctx: ServerContext) -> ResponseRun:
    """Check the request (APIError 4xx naming its field), build the chat request and queue it."""
    if req.background:
        raise APIError("background is not supported by jaxkv", 400, "background")
    for name in ("conversation", "prompt"):  # OpenAI's stored conversations and prompts
        if (req.model_extra or {}).get(name) is not None:
            raise APIError(f"{name} is not supported by jaxkv (previous_response_id is)", 400, name)
    previous = _previous(req, ctx)
    messages = [*previous, *input_messages(req.input)]
    extra = {k: v for k, v in (req.model_extra or {}).items() if k not in ("conversation", "prompt")}
    body = {**extra, **chat_fields(req), "stream": req.stream}
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    try:
        chat_req = ChatCompletionRequest.model_validate({**body, "messages": system + messages})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        field = FIELDS.get(str(err["loc"][0]), str(err["loc"][0]))
        raise APIError(f"{field}: {err['msg']} ({loc})"[:300], 400, field) from e
    try:
        chat = prepare_chat(chat_req, ctx)
    except APIError as e:
        raise _relabel(e) from e
    return ResponseRun(req, ctx, chat, messages)


def _relabel(e: APIError) -> APIError:
    head = (e.param or "").split(".")[0].split("[")[0]
    if head not in FIELDS:
        return e
    msg = e.message.replace(head, FIELDS[head], 1) if e.message.startswith(head) else e.message
    return APIError(msg, e.status, FIELDS[head])


def _previous(req: ResponsesRequest, ctx: ServerContext) -> list[dict]:
    """The stored conversation of previous_response_id ([] without one)."""
    if req.previous_response_id is None:
        return []
    if ctx.response_store is None:
        raise APIError("previous_response_id needs the response store, which is off (start "
                       "the server with --enable-responses-api-store)", 400, "previous_response_id")
    found = ctx.response_store.get(req.previous_response_id)
    if found is None:
        raise APIError(f"Response with id '{req.previous_response_id}' not found.", 404,
                       "previous_response_id")
    return list(found[1])


def chat_fields(req: ResponsesRequest) -> dict:
    """The chat request's fields from the Responses request's (input and instructions aside)."""
    out = {"model": req.model, "temperature": req.temperature, "top_p": req.top_p,
           "max_tokens": req.max_output_tokens, "user": req.user,
           "parallel_tool_calls": req.parallel_tool_calls}
    if req.include and LOGPROBS_INCLUDE in req.include:
        out.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.tools is not None:
        out["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        c = req.tool_choice
        out["tool_choice"] = c if isinstance(c, str) else {"type": "function",
                                                           "function": {"name": c.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        rf = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError("text.format.schema must be given for type json_schema", 400,
                               "text.format")
            rf["json_schema"] = {"name": fmt.name or "response", "schema": fmt.json_schema,
                                 "strict": fmt.strict, "description": fmt.description}
        out["response_format"] = rf
    return out


def _chat_tool(t: dict, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        raise APIError(f"tools[{i}].type: only function tools are supported by jaxkv, got "
                       f"{kind!r}", 400, "tools")
    if not isinstance(t.get("name"), str) or not t["name"]:
        raise APIError(f"tools[{i}].name: a function tool needs a name", 400, "tools")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def input_messages(inp) -> list[dict]:
    """`input` as chat messages: a string is one user message; items in order (consecutive
    function_call items are one assistant turn). APIError 400 naming the item."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not inp:
        raise APIError("input must not be empty", 400, "input")
    out: list[dict] = []
    for i, item in enumerate(inp):
        if not isinstance(item, dict):
            raise APIError(f"input[{i}]: an item must be an object", 400, "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            call = _function_call(item, i)
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") \
                    and out[-1]["content"] is None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", i),
                        "content": _output_text(item.get("output"), i)})
        elif kind == "reasoning":
            continue  # a reasoning item of an earlier turn: not shown to the model again
        else:
            raise APIError(f"input[{i}].type: {kind!r} is not supported (message, "
                           "function_call, function_call_output)", 400, "input")
    return out


def _text(item: dict, key: str, i: int) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v:
        raise APIError(f"input[{i}].{key} must be a non-empty string", 400, "input")
    return v


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise APIError(f"input[{i}].role must be user, system, developer or assistant, got "
                       f"{role!r}", 400, "input")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(f"input[{i}].content must be a string or a list of parts", 400, "input")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str):
            raise APIError(f"input[{i}].content[{j}].type: only text parts (input_text, "
                           f"output_text) are supported, got {kind!r}", 400, "input")
        parts.append({"type": "text", "text": p["text"]})
    return {"role": role, "content": parts}


def _function_call(item: dict, i: int) -> dict:
    args = item.get("arguments", "")
    if not isinstance(args, str):
        raise APIError(f"input[{i}].arguments must be a JSON text", 400, "input")
    return {"id": _text(item, "call_id", i), "type": "function",
            "function": {"name": _text(item, "name", i), "arguments": args}}


def _output_text(output, i: int) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                        for p in output):
        return "".join(p["text"] for p in output)
    raise APIError(f"input[{i}].output must be a string or a list of text parts", 400, "input")


def chat_output_items(choice: dict) -> list[dict]:
    """A collected chat choice's message as output items: its reasoning (with
    --reasoning-parser), the text (when there is some, or no tool call), then each tool call."""
    msg, status = choice["message"], "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = msg.get("tool_calls") or []
    lp = choice.get("logprobs")
    items = [reasoning_item(msg["reasoning_content"])] if msg.get("reasoning_content") else []
    if msg.get("content") or not calls:
        items.append(message_item(msg.get("content") or "", status,
                                  responses_logprobs(lp["content"]) if lp else None))
    items += [function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
              for c in calls]
    return items


class ResponseRun:
    """A queued Responses request: the chat run behind it, and the Response it becomes."""

    def __init__(self, req: ResponsesRequest, ctx: ServerContext, chat, messages: list[dict]):
        self.req, self.ctx, self.chat, self.messages = req, ctx, chat, messages
        self.id, self.created_at = new_id("resp"), int(time.time())

    def response(self, output: list[dict], status: str, usage: dict | None) -> dict:
        """The Response object (status in_progress, completed or incomplete)."""
        req = self.req
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "model": self.ctx.model_name, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "output": output,
            "parallel_tool_calls": bool(req.parallel_tool_calls),
            "previous_response_id": req.previous_response_id,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs,
            "tool_choice": _tool_choice(req), "tools": [_tool_echo(t) for t in req.tools or []],
            "text": {"format": text_format}, "truncation": req.truncation or "disabled",
            "store": bool(req.store and self.ctx.response_store is not None),
            "user": req.user, "usage": _usage(usage) if usage is not None else None,
        }

    def finish(self, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
        """The finished Response; stored when the store is on and the request asks for it."""
        status = "incomplete" if finish_reason == "length" else "completed"
        resp = self.response(output, status, usage)
        if resp["store"]:
            self.ctx.response_store.put(resp, self.messages + _as_messages(output))
        return resp


def _tool_choice(req: ResponsesRequest):
    c = req.tool_choice
    if c is None:
        return "auto" if req.tools else "none"
    return c if isinstance(c, str) else {"type": "function", "name": c.name}


def _tool_echo(t: dict) -> dict:
    return {"type": "function", "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("parameters"), "strict": t.get("strict")}


def _usage(u: dict) -> dict:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}


def _as_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a later turn shows the model (one assistant turn)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    msg = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]
