"""The Responses API's stream: the chat run's chunks as the typed events the openai client
reads (`client.responses.stream`, `responses.create(stream=True)`).

Order, as OpenAI's: response.created and response.in_progress (status in_progress, no output);
for the text, response.output_item.added (a message), response.content_part.added
(output_text), response.output_text.delta per chunk, then response.output_text.done,
response.content_part.done and response.output_item.done; for each tool call,
response.output_item.added (a function_call), response.function_call_arguments.delta,
response.function_call_arguments.done and response.output_item.done; last
response.completed with the whole Response (whose status says "incomplete" when
max_output_tokens ran out: vLLM sends response.completed then too, and the openai client's
get_final_response() waits for that event). Every event carries its sequence_number. Server-Sent Events with `event:` lines and
no [DONE], as OpenAI sends them; an engine failure midway is an `error` event.
"""

from __future__ import annotations

import json

from jaxkv.engine.async_llm import EngineDeadError
from serve.responses_protocol import (function_call_item, message_item, new_id, reasoning_item,
                                      responses_logprobs)


async def response_events(run):
    """SSE text of the events of `run` (a serve.responses.ResponseRun); its chat batch is
    aborted when the stream ends early."""
    events = _Events(run)
    try:
        async for ev in events.all():
            yield f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n"
    except EngineDeadError as e:
        ev = {"type": "error", "code": "engine_dead", "message": str(e), "param": None,
              "sequence_number": events.seq}
        yield f"event: error\ndata: {json.dumps(ev)}\n\n"
    finally:
        run.chat.batch.abort()


class _Events:
    def __init__(self, run):
        self.run, self.seq = run, 0
        self.output: list[dict] = []      # finished items
        self.text: dict | None = None      # the open message: {"id", "index", "text", "logprobs"}
        self.thought: dict | None = None   # the open reasoning item: {"id", "index", "text"}
        self.calls: dict[int, dict] = {}   # chat tool-call index -> the open function_call
        self.finish = None
        self.want_lp = run.chat.k is not None

    def ev(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    async def all(self):
        start = self.run.response([], "in_progress", None)
        yield self.ev("response.created", response=start)
        yield self.ev("response.in_progress", response=start)
        async for chunk in self.run.chat.chunks():
            for ch in chunk.choices:
                for e in self.delta(ch):
                    yield e
        for e in self.close_all():
            yield e
        if not any(it["type"] != "reasoning" for it in self.output):  # no answer: an empty
            # message, as the collected response has
            for e in self.open_text() + self.close_text():
                yield e
        resp = self.run.finish(self.output, self.finish, self.run.chat.usage.info().model_dump())
        yield self.ev("response.completed", response=resp)  # status incomplete inside, as vLLM

    def delta(self, ch) -> list[dict]:
        out = []
        d = ch.delta
        if d.reasoning_content:
            out += self.reasoning_delta(d.reasoning_content)
        if (d.content or d.tool_calls) and self.thought is not None:
            out += self.close_thought()
        if d.content:
            if self.text is None:
                out += self.close_calls() + self.open_text()
            lp = responses_logprobs([x.model_dump() for x in ch.logprobs.content]) \
                if self.want_lp and ch.logprobs is not None else []
            self.text["text"] += d.content
            self.text["logprobs"] += lp
            out.append(self.ev("response.output_text.delta", item_id=self.text["id"],
                               output_index=self.text["index"], content_index=0,
                               delta=d.content, logprobs=lp))
        for tc in d.tool_calls or []:
            out += self.call_delta(tc)
        if ch.finish_reason is not None:
            self.finish = ch.finish_reason
        return out

    def open_text(self) -> list[dict]:
        self.text = {"id": new_id("msg"), "index": len(self.output), "text": "", "logprobs": []}
        item = {"type": "message", "id": self.text["id"], "status": "in_progress",
                "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.ev("response.output_item.added", output_index=self.text["index"], item=item),
                self.ev("response.content_part.added", item_id=self.text["id"],
                        output_index=self.text["index"], content_index=0, part=part)]

    def close_text(self) -> list[dict]:
        t, self.text = self.text, None
        status = "incomplete" if self.finish == "length" else "completed"
        item = message_item(t["text"], status, t["logprobs"] if self.want_lp else None, t["id"])
        self.output.append(item)
        common = {"item_id": t["id"], "output_index": t["index"], "content_index": 0}
        return [self.ev("response.output_text.done", **common, text=t["text"], logprobs=t["logprobs"]),
                self.ev("response.content_part.done", **common, part=item["content"][0]),
                self.ev("response.output_item.done", output_index=t["index"], item=item)]

    def call_delta(self, tc) -> list[dict]:
        out = []
        call = self.calls.get(tc.index)
        if call is None:
            if self.text is not None:
                out += self.close_text()
            call = self.calls[tc.index] = {"id": new_id("fc"), "index": len(self.output) + len(self.calls),
                                           "call_id": tc.id, "name": "", "arguments": ""}
            if tc.function is not None and tc.function.name:
                call["name"] = tc.function.name
            item = {**function_call_item(call["call_id"], call["name"], "", call["id"]),
                    "status": "in_progress"}
            out.append(self.ev("response.output_item.added", output_index=call["index"], item=item))
        args = tc.function.arguments if tc.function is not None else None
        if args:
            call["arguments"] += args
            out.append(self.ev("response.function_call_arguments.delta", item_id=call["id"],
                               output_index=call["index"], delta=args))
        return out

    def close_calls(self) -> list[dict]:
        out = []
        for i in sorted(self.calls):
            c = self.calls[i]
            item = function_call_item(c["call_id"], c["name"], c["arguments"], c["id"])
            self.output.append(item)
            out += [self.ev("response.function_call_arguments.done", item_id=c["id"],
                            output_index=c["index"], name=c["name"], arguments=c["arguments"]),
                    self.ev("response.output_item.done", output_index=c["index"], item=item)]
        self.calls = {}
        return out

    def reasoning_delta(self, text: str) -> list[dict]:
        out = []
        if self.thought is None:
            self.thought = {"id": new_id("rs"), "index": len(self.output), "text": ""}
            item = {**reasoning_item("", "in_progress", self.thought["id"]), "content": []}
            out.append(self.ev("response.output_item.added", output_index=self.thought["index"],
                               item=item))
        self.thought["text"] += text
        out.append(self.ev("response.reasoning_text.delta", item_id=self.thought["id"],
                           output_index=self.thought["index"], content_index=0, delta=text))
        return out

    def close_thought(self) -> list[dict]:
        t, self.thought = self.thought, None
        item = reasoning_item(t["text"], "completed", t["id"])
        self.output.append(item)
        return [self.ev("response.reasoning_text.done", item_id=t["id"], output_index=t["index"],
                        content_index=0, text=t["text"]),
                self.ev("response.output_item.done", output_index=t["index"], item=item)]

    def close_all(self) -> list[dict]:
        return ((self.close_thought() if self.thought is not None else [])
                + (self.close_text() if self.text is not None else []) + self.close_calls())
