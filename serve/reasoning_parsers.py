"""--reasoning-parser: a thinking model's `<think>...</think>` block apart from its answer, as
vLLM's reasoning parsers split it (chat: `reasoning_content` beside `content`, in responses and
stream deltas; the Responses API: a reasoning item before the message).

- `qwen3`: the block is reasoning only when the model writes its opening `<think>`; text with
  no opening tag is all content (Qwen3 with thinking turned off). Text before the block is
  content too.
- `deepseek_r1`: the chat template opens the block in the prompt, so the output is reasoning
  from its first token (a leading `<think>` is dropped) until `</think>`, and content after
  it; an output that never closes the block is all reasoning. A request whose output a
  grammar constrains (structured outputs, a named or required tool) starts with its answer,
  so its whole output is content.

One state machine serves both a whole text and a stream: `ReasoningSplitter.feed(delta)`
returns the (reasoning, content) text it can classify so far, holding back the end of a delta
that may be the start of a tag ("<thi"), and `flush()` the rest; the pieces of a stream join
to exactly what `split()` gives for the whole text.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """The (reasoning, content) split of one output, fed piece by piece."""

    def __init__(self, parser: str, constrained: bool = False):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {parser!r}")
        opens_in_prompt = parser == "deepseek_r1" and not constrained
        # states: "lead" (deepseek_r1: a leading <think> may come), "reasoning", "watch"
        # (qwen3: content until an opening tag), "content" (the block is over)
        self.state = "lead" if opens_in_prompt else ("watch" if parser == "qwen3" else "content")
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = [], []
        while True:
            if self.state == "lead":
                if START.startswith(self.buf) and len(self.buf) < len(START):
                    break  # maybe the opening tag: wait
                if self.buf.startswith(START):
                    self.buf = self.buf[len(START):]
                self.state = "reasoning"
            elif self.state == "reasoning":
                if not self._until(END, reasoning, "content"):
                    break
            elif self.state == "watch":
                if not self._until(START, content, "reasoning"):
                    break
            else:
                content.append(self.buf)
                self.buf = ""
                break
        return "".join(reasoning), "".join(content)

    def _until(self, tag: str, out: list[str], then: str) -> bool:
        """Move the buffer's text before `tag` to `out`; True (state `then`, the tag dropped)
        when the tag was there, else False with a possible start of it held back."""
        at = self.buf.find(tag)
        if at < 0:
            keep = len(self.buf) - _partial_tail(self.buf, tag)
            out.append(self.buf[:keep])
            self.buf = self.buf[keep:]
            return False
        out.append(self.buf[:at])
        self.buf, self.state = self.buf[at + len(tag):], then
        return True

    def flush(self) -> tuple[str, str]:
        """What is held back at the end of the output (a partial tag is text after all)."""
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state in ("lead", "reasoning") else ("", rest)


def split(parser: str, text: str, constrained: bool = False) -> tuple[str | None, str | None]:
    """(reasoning or None, content or None) of a whole output; None where a part is empty
    (vLLM's reasoning_content null when there is none)."""
    s = ReasoningSplitter(parser, constrained)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return (r1 + r2) or None, (c1 + c2) or None
