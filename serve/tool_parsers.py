"""Tool-call parsers for tool_choice="auto" (--tool-call-parser), as vLLM's.

``hermes``: the format of Hermes 2 Pro, Qwen2.5 and many fine-tunes: the model writes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per call), any text
before the first block is the message content. As vLLM's Hermes2ProToolParser: if a block does
not parse as JSON with a name, the whole output is plain content.
"""

from __future__ import annotations

import json
import re

START, END = "<tool_call>", "</tool_call>"
_BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_CLOSED = re.compile(r"\s*<tool_call>(.*?)</tool_call>", re.DOTALL)

TOOL_CALL_PARSERS = ("hermes",)


def parse_call(body: str) -> tuple[str, str]:
    """A block's JSON -> (function name, arguments as JSON text). ValueError if it is not a
    call (not JSON, no string name, arguments neither an object nor a JSON text)."""
    obj = json.loads(body.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call needs a name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        json.loads(args)
        return obj["name"], args
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return obj["name"], json.dumps(args, ensure_ascii=False)


def extract_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole output -> (content or None, [(name, arguments JSON)]). Without a parsable
    block: (text, [])."""
    if START not in text:
        return text, []
    try:
        calls = [parse_call(a or b) for a, b in _BLOCKS.findall(text)]
    except ValueError:  # json.JSONDecodeError included
        return text, []
    content = text[:text.index(START)]
    return (content if content.strip() else None), calls


class HermesStream:
    """The same, fed a stream's text deltas: content is passed on at once except a tail that
    may begin a <tool_call> tag; each call is emitted once its block closes."""

    def __init__(self):
        self.buf = ""
        self.in_calls = False

    def feed(self, delta: str) -> tuple[str, list[tuple[str, str]]]:
        """(content to send now, calls completed by this delta)."""
        self.buf += delta
        content = ""
        if not self.in_calls:
            i = self.buf.find(START)
            if i < 0:
                keep = next((k for k in range(min(len(START) - 1, len(self.buf)), 0, -1)
                             if START.startswith(self.buf[-k:])), 0)
                content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return content, []
            content, self.buf, self.in_calls = self.buf[:i], self.buf[i:], True
        calls = []
        while (m := _CLOSED.match(self.buf)) is not None:
            try:
                calls.append(parse_call(m.group(1)))
            except ValueError:
                content += m.group(0)  # not a call: its text is content, as vLLM
            self.buf = self.buf[m.end():]
        return content, calls

    def end(self) -> tuple[str, list[tuple[str, str]]]:
        """At the end of the output: an unclosed block that parses is a call; any other
        leftover text is content."""
        rest, self.buf = self.buf, ""
        if self.in_calls and rest.strip().startswith(START):
            try:
                return "", [parse_call(rest.strip()[len(START):])]
            except ValueError:
                pass
        return (rest if rest.strip() else ""), []
