"""Tool-call parsers for tool_choice="auto" (--tool-call-parser), as vLLM's.

``hermes``: the format of Hermes 2 Pro, Qwen2.5 and many fine-tunes: the model writes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per call); the text
before the first block is the message content. Whole outputs and streams read the same way:
each block that parses as JSON with a name is a call; a block that does not, and any text
between or after blocks that is not only whitespace, stays content (vLLM's non-streaming
parser turns the whole output into content when one block fails, its streaming one does not;
jaxkv keeps both to this one rule, so nothing the model wrote is lost).
"""

from __future__ import annotations

import json
import re

START, END = "<tool_call>", "</tool_call>"
_CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

TOOL_CALL_PARSERS = ("hermes",)


def parse_call(body: str) -> tuple[str, str]:
    """A block's JSON -> (function name, arguments as JSON text). ValueError if it is not a
    call (not JSON, no string name, arguments neither an object nor a JSON text of one)."""
    obj = json.loads(body.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a tool call needs a name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return obj["name"], json.dumps(args, ensure_ascii=False)


def extract_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole output -> (content or None when it is only whitespace around calls,
    [(name, arguments JSON)])."""
    stream = HermesStream()
    content, calls = stream.feed(text)
    more, last = stream.end()
    content += more
    calls += last
    if not calls:
        return text, []
    return (content if content.strip() else None), calls


class HermesStream:
    """The parser fed a stream's text deltas: content is passed on at once, except a tail
    that may begin a <tool_call> tag and, once the calls began, text that may turn out to be
    only whitespace between blocks; each call is emitted once its block closes."""

    def __init__(self):
        self.buf = ""        # text not yet classified
        self.in_calls = False  # a block has started

    def feed(self, delta: str) -> tuple[str, list[tuple[str, str]]]:
        """(content to send now, calls completed by this delta)."""
        self.buf += delta
        content, calls = "", []
        while True:
            i = self.buf.find(START)
            if i < 0:
                break
            m = _CLOSED.match(self.buf, i)
            if m is None:  # an open block: wait for its end
                content += self._between(self.buf[:i])
                self.buf, self.in_calls = self.buf[i:], True
                return content, calls
            content += self._between(self.buf[:i])
            self.in_calls = True
            try:
                calls.append(parse_call(m.group(1)))
            except ValueError:
                content += m.group(0)  # not a call: its text is content
            self.buf = self.buf[m.end():]
        # No tag in buf: keep a tail that may begin one (and, between blocks, whitespace).
        keep = next((k for k in range(min(len(START) - 1, len(self.buf)), 0, -1)
                     if START.startswith(self.buf[-k:])), 0)
        head = self.buf[:len(self.buf) - keep]
        if self.in_calls and not head.strip():
            return content, calls  # maybe only whitespace before the next block
        content += head
        self.buf = self.buf[len(head):]
        return content, calls

    def _between(self, text: str) -> str:
        """Text before a block: content, unless it is only whitespace after a block."""
        return text if (not self.in_calls or text.strip()) else ""

    def end(self) -> tuple[str, list[tuple[str, str]]]:
        """At the end of the output: an unclosed block that parses is a call; other
        leftover text is content (whitespace after a block is dropped)."""
        rest, self.buf = self.buf, ""
        body = rest.lstrip()
        if body.startswith(START):
            try:
                return "", [parse_call(body[len(START):])]
            except ValueError:
                pass
        return self._between(rest), []
