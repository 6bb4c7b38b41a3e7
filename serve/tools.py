"""Tool calling on /v1/chat/completions, as vLLM serves it.

`tools` reach the chat template as transformers passes them (the list of {"type":
"function", "function": {...}} dicts). `tool_choice`:
- "none": the model answers in text (the tools are still shown to the template);
- a named function: the output is that function's arguments, enforced with its parameters'
  JSON schema; "required": a JSON array of {"name", "parameters"} calls (at least one; one
  with parallel_tool_calls=false), enforced with a schema built from every tool, as vLLM's
  (jaxkv closes each call object to those two keys);
- "auto" (the default when tools are given): the model chooses; its output is parsed with
  --tool-call-parser (hermes), which needs --enable-auto-tool-choice.
Responses carry `tool_calls` (id chatcmpl-tool-<hex>, type, function name, arguments as a
JSON text) and, as vLLM's, finish_reason "tool_calls" for auto and required calls ("stop" for
a named one; content "" for named and required); streams send the deltas the openai client
joins.
"""

from __future__ import annotations

import json
import uuid

from jaxkv.structured_outputs.params import StructuredOutputsParams
from serve import tool_parsers
from serve.errors import APIError
from serve.protocol_responses import DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall


def tool_mode(req, ctx) -> str:
    """"none" | "auto" | "required" | "named", checked against the request's tools and the
    server's flags (APIError 400 naming tool_choice or tools)."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be unique", 400, "tools")
    if choice == "none":
        return "none"
    if not req.tools:
        raise APIError(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs "
                       "tools", 400, "tool_choice")
    if choice == "auto":
        if not (ctx.enable_auto_tool_choice and ctx.tool_call_parser):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", 400, "tool_choice")
        return "auto"
    if choice == "required":
        return "required"
    if choice.function.name not in names:
        raise APIError(f"tool_choice: tool {choice.function.name!r} has not been passed in "
                       "`tools`", 400, "tool_choice")
    return "named"


def template_tools(req) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(req, mode: str) -> StructuredOutputsParams | None:
    """The JSON schema that enforces a named or required tool choice (None otherwise)."""
    if mode == "named":
        tool = next(t for t in req.tools if t.function.name == req.tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    if mode == "required":
        items = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t.function.name]},
                            "parameters": _parameters(t)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in req.tools]}
        schema = {"type": "array", "minItems": 1, "items": items}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    return None


def _id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _finish(finish: str | None, called: bool) -> str | None:
    """vLLM's rule: "tool_calls" for auto and required calls; a named call keeps "stop"."""
    return "tool_calls" if called and finish == "stop" else finish


class ToolOutput:
    """One choice's text turned into content and tool calls (whole, or as stream deltas)."""

    def __init__(self, mode: str, req):
        self.mode = mode
        self.name = req.tool_choice.function.name if mode == "named" else None
        self.stream = tool_parsers.HermesStream() if mode == "auto" else None
        self.text = ""
        self.num_calls = 0
        self.named_id: str | None = None

    def message(self, text: str, finish: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish_reason) of a whole output."""
        if self.mode == "named":  # content "" and finish_reason as is, as vLLM
            return "", [ToolCall(id=_id(), function=FunctionCall(name=self.name, arguments=text))], finish
        calls = self._required(text) if self.mode == "required" else None
        if self.mode == "auto":
            content, found = tool_parsers.extract_tool_calls(text)
            if found:
                calls = found
                text = content
        if not calls:
            return text, [], finish
        return (text if self.mode == "auto" else ""), \
            [ToolCall(id=_id(), function=FunctionCall(name=n, arguments=a)) for n, a in calls], \
            _finish(finish, True)

    @staticmethod
    def _required(text: str) -> list[tuple[str, str]] | None:
        try:
            return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return None  # cut by max_tokens: the text stays content

    def deltas(self, text: str) -> list[DeltaMessage]:
        """Stream deltas for new output text."""
        if self.mode == "named":
            if not text:
                return []
            first = self.named_id is None
            if first:
                self.named_id = _id()
                self.num_calls = 1
            fn = DeltaFunctionCall(name=self.name if first else None, arguments=text)
            return [DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, id=self.named_id if first else None, type="function" if first else None,
                function=fn)])]
        if self.mode == "required":
            self.text += text
            return []
        content, calls = self.stream.feed(text)
        return self._out(content, calls)

    def end(self, finish: str | None) -> tuple[list[DeltaMessage], str | None]:
        """The last deltas and the finish_reason once the output ended."""
        if self.mode == "required":
            calls = self._required(self.text)
            out = self._out("", calls) if calls else [DeltaMessage(content=self.text)] if self.text else []
        elif self.mode == "auto":
            out = self._out(*self.stream.end())
        else:
            out = []
        return out, _finish(finish, self.num_calls > 0 and self.mode != "named")

    def _out(self, content: str, calls) -> list[DeltaMessage]:
        out = [DeltaMessage(content=content)] if content else []
        for name, args in calls or []:
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=self.num_calls, id=_id(), type="function",
                function=DeltaFunctionCall(name=name, arguments=args))]))
            self.num_calls += 1
        return out
