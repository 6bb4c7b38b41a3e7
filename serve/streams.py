"""Plumbing shared by the generation routes: adding a batch of requests atomically, merging
their output streams, Server-Sent Events, and aborting on client disconnect."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from jaxkv.engine.async_llm import AsyncLLM, EngineDeadError
from serve.errors import APIError, bad_request, error_body
from serve.protocol import UNSUPPORTED

logger = logging.getLogger("jaxkv")


class RequestBatch:
    """The engine requests behind one HTTP request (one per prompt). `add` validates every
    prompt before queueing any, so a bad one loses nothing; `abort` stops whatever is still
    running (client gone). Iterate with `merged()` for (prompt index, RequestOutput)."""

    def __init__(self, engine: AsyncLLM, base_id: str):
        self.engine, self.base_id = engine, base_id
        self.ids: list[str] = []
        self.streams = []
        self.processed = []   # EngineCoreRequest per prompt, as the engine checked them
        self.finished: set[int] = set()

    def add(self, prompts, params) -> None:
        ids = [self.base_id if len(prompts) == 1 else f"{self.base_id}-{i}" for i in range(len(prompts))]
        try:
            processed = [self.engine.process_inputs(rid, p, params) for rid, p in zip(ids, prompts)]
        except EngineDeadError as e:
            raise APIError(str(e), 503) from e
        except ValueError as e:
            raise bad_request(e) from e
        self.ids, self.processed = ids, processed
        try:
            for pr in processed:
                self.streams.append(self.engine.add_processed(pr))
        except (EngineDeadError, ValueError) as e:  # nothing of this batch may run
            self.ids = self.ids[:len(self.streams)]  # never abort an id that is not ours
            self.abort()
            if isinstance(e, EngineDeadError):
                raise APIError(str(e), 503) from e
            raise bad_request(e) from e  # an id taken meanwhile

    async def merged(self) -> AsyncIterator[tuple[int, object]]:
        """Outputs of all streams in arrival order."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                if out.finished:
                    self.finished.add(0)
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    await q.put((i, out))
                await q.put((i, None))
            except BaseException as e:  # noqa: BLE001 - hand engine errors to the consumer
                await q.put((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.finished.add(i)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def abort(self) -> None:
        left = [rid for i, rid in enumerate(self.ids) if i not in self.finished]
        if left:
            self.engine.abort(left)


def check_unsupported(req, chat: bool = False) -> None:
    """400 for request fields jaxkv does not implement (protocol.UNSUPPORTED,
    add_special_tokens=true on chat: its template writes every special token), rather than
    silently ignoring them; other unknown fields are ignored with a warning, as vLLM does."""
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be set when stream is true", 400, "stream_options")
    extra = dict(req.model_extra or {})
    for name, value in extra.items():
        if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
            if name in ("tools", "tool_choice"):
                raise APIError(f"{name}: tools are supported on /v1/chat/completions only", 400, name)
            raise APIError(f"{name} is not supported by jaxkv (got {value!r})"[:300], 400, name)
    if chat and extra.get("add_special_tokens", False) is not False:
        raise APIError("add_special_tokens=true is not supported on chat completions (the chat "
                       "template writes the special tokens)", 400, "add_special_tokens")
    ignored = sorted(set(extra) - set(UNSUPPORTED) - {"add_special_tokens"})
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", ignored)


def sse(obj: BaseModel | dict) -> str:
    """One Server-Sent Event carrying obj (a response model, or its dict) as JSON."""
    data = obj.model_dump() if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_events(batch: RequestBatch, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """`data: {chunk}` lines, then `data: [DONE]`. An engine failure after the headers went
    out becomes an error event; leaving early (client gone) aborts the batch."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except EngineDeadError as e:
        yield sse(error_body(str(e), 503))
    finally:
        batch.abort()
    yield "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator however the response ends, so a
    client that disconnects aborts its requests at once (not when the generator is
    garbage-collected)."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def collect_or_abort(raw: Request, batch: RequestBatch, coro):
    """Run a non-streaming request to its end, unless the client disconnects first: then
    its requests are aborted (blocks freed) and None is returned."""
    work = asyncio.ensure_future(coro)

    async def disconnected():
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        logger.info("client disconnected; aborting %s", batch.base_id)
        return None
    except EngineDeadError as e:
        raise APIError(str(e), 503) from e
    finally:
        watch.cancel()
        work.cancel()
        batch.abort()
