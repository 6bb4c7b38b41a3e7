"""POST /v1/chat/completions (OpenAI's chat completions API, as vLLM serves it).

The messages are rendered with the model's chat template (transformers'
apply_chat_template; add_generation_prompt, continue_final_message, chat_template_kwargs and
documents as vLLM takes them) and tokenized without adding special tokens again; text typed in
a message never becomes a control token (jaxkv.chat_utils). echo prepends the last message's
content, as vLLM. max_completion_tokens wins over max_tokens; with neither, a request may
generate what is left of max_model_len after its prompt.
"""

from __future__ import annotations

import re
import time
import uuid

from jaxkv import chat_utils
from serve.context import OUTPUT_KIND, ServerContext
from serve.errors import APIError, bad_request
from serve.protocol import ChatCompletionRequest
from serve.protocol_responses import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                      ChatCompletionLogProbsContent, ChatCompletionResponse,
                                      ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                      ChatCompletionStreamResponse, ChatMessage, DeltaMessage, UsageInfo)
from serve.response_format import relabel, request_constraint
from serve.tools import ToolOutput, template_tools, tool_constraint, tool_mode
from serve.streams import RequestBatch, SSEResponse, check_unsupported, collect_or_abort, sse_events
from serve.reasoning_parsers import ReasoningSplitter
from serve.reasoning_parsers import split as reasoning_split
from serve.usage import UsageAccumulator, continuous_usage


def chat_request_prompt(tokenizer, req, chat_template: str | None = None) -> dict:
    """The request's messages -> {"prompt": text, "prompt_token_ids": ids} (jaxkv.chat_utils:
    control tokens only from the template); APIError 400 naming the field if a message or
    the template's options are bad."""
    if not req.messages:
        raise APIError("messages must not be empty", 400, "messages")
    kwargs = dict(req.chat_template_kwargs or {})
    if getattr(req, "documents", None):
        kwargs["documents"] = req.documents
    try:
        text, ids = chat_utils.render_chat(
            tokenizer, [m.as_dict() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template=chat_template,
            chat_template_kwargs=kwargs, tools=template_tools(req) if hasattr(req, "tools") else None)
    except ValueError as e:
        raise bad_request(e) from e
    return {"prompt": text, "prompt_token_ids": ids}


_HEX = re.compile(r"\\x([0-9a-fA-F]{2})")


def token_bytes(text: str | None) -> list[int]:
    """The bytes of a logprob entry's token: its UTF-8 text, or for a token holding part of a
    character the bytes its `bytes:\\xNN...` text spells."""
    if text and text.startswith("bytes:"):
        return list(bytes(int(h, 16) for h in _HEX.findall(text[6:])))
    return list((text or "").encode())


def _logprob_content(entries, token_ids, k: int) -> list[ChatCompletionLogProbsContent]:
    out = []
    for tid, d in zip(token_ids, entries):
        lp = d[tid]
        top = sorted(d.values(), key=lambda x: x.rank or 0)[:k]
        out.append(ChatCompletionLogProbsContent(
            token=lp.decoded_token, logprob=lp.logprob, bytes=token_bytes(lp.decoded_token),
            top_logprobs=[ChatCompletionLogProb(token=x.decoded_token, logprob=x.logprob,
                                                bytes=token_bytes(x.decoded_token)) for x in top]))
    return out


async def create_chat_completion(req: ChatCompletionRequest, ctx: ServerContext, raw):
    run = prepare_chat(req, ctx)
    if req.stream:
        return SSEResponse(sse_events(run.batch, run.chunks()))
    return await collect_or_abort(raw, run.batch, run.collect())


def prepare_chat(req: ChatCompletionRequest, ctx: ServerContext) -> "_ChatRun":
    """Check the request (APIError 4xx naming the field), render and queue it."""
    ctx.check_model(req.model)
    check_unsupported(req, chat=True)
    mode = tool_mode(req, ctx)
    constraint, field = request_constraint(req)
    if mode in ("named", "required"):
        if constraint is not None:
            raise APIError(f"{field} cannot be combined with tool_choice {mode!r} (the tool's "
                           "schema is the constraint)", 400, field)
        constraint, field = tool_constraint(req, mode), "tools"
    tok = ctx.engine.get_tokenizer()
    prompt = chat_request_prompt(tok, req, ctx.chat_template)
    k = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
    try:
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, k,
                                     structured_outputs=constraint)
    except ValueError as e:
        raise bad_request(e) from e
    params.output_kind = OUTPUT_KIND
    # As vLLM: the reply's role is the assistant's, or the last message's when no generation
    # prompt is added; echo prepends the last message's content when its role is that one.
    role = "assistant" if req.add_generation_prompt else req.messages[-1].role
    last = req.messages[-1]
    echo = chat_utils.normalize_messages([last.as_dict()])[0]["content"] if req.echo and last.role == role else ""
    batch = RequestBatch(ctx.engine, f"chatcmpl-{uuid.uuid4().hex}")
    try:
        batch.add([prompt], params)
    except APIError as e:
        raise relabel(e, field) from e
    return _ChatRun(req, ctx, mode, k, role, echo, batch, constrained=constraint is not None)


class _ChatRun:
    """A queued chat completion: its stream of chunks, or its collected response."""

    def __init__(self, req, ctx, mode: str, k: int | None, role: str, echo: str,
                 batch: RequestBatch, constrained: bool = False):
        self.req, self.ctx, self.mode, self.k = req, ctx, mode, k  # k: top logprobs, or None
        self.role, self.echo, self.batch = role, echo, batch
        self.constrained = constrained  # a grammar shapes the output (structured outputs, tools)
        self.reasoning = {}  # choice index -> its ReasoningSplitter (with --reasoning-parser)
        self.rid, self.created = batch.base_id, int(time.time())
        self.usage = UsageAccumulator(continuous_usage(req))
        self.tools = {}  # choice index -> ToolOutput (tool calls parsed from its text)

    def tool_output(self, index: int) -> ToolOutput | None:
        if self.mode == "none":
            return None
        return self.tools.setdefault(index, ToolOutput(self.mode, self.req))

    def lp_block(self, c) -> ChatCompletionLogProbs | None:
        if self.k is None:
            return None
        return ChatCompletionLogProbs(content=_logprob_content(c.logprobs or [], c.token_ids, self.k))

    def chunk(self, choices, usage_info: UsageInfo | None = None) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=self.rid, created=self.created,
                                            model=self.ctx.model_name, choices=choices, usage=usage_info)

    def one(self, index, delta: DeltaMessage, logprobs=None, finish=None, stop_reason=None,
            minus: int = 0):
        """A chunk of choice `index` (with continuous usage stats, its usage so far)."""
        return self.chunk([ChatCompletionResponseStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason)],
            self.usage.so_far(self.batch.base_id, index, minus))

    async def chunks(self):
        """OpenAI's order per choice: the role, then content chunks (finish_reason null), then
        one chunk with an empty delta that carries the finish_reason; usage last if asked."""
        started = set()
        async for _, out in self.batch.merged():
            self.usage.add(out)
            for c in out.outputs:
                if c.index not in started:
                    started.add(c.index)
                    yield self.one(c.index, DeltaMessage(role=self.role, content=""),
                                   minus=len(c.token_ids))
                    if self.echo:
                        yield self.one(c.index, DeltaMessage(content=self.echo), minus=len(c.token_ids))
                for chunk in self._choice_chunks(c):
                    yield chunk
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self.chunk([], self.usage.info())

    def splitter(self, index: int) -> ReasoningSplitter | None:
        """Choice `index`'s reasoning splitter (None without --reasoning-parser)."""
        if self.ctx.reasoning_parser is None:
            return None
        if index not in self.reasoning:
            self.reasoning[index] = ReasoningSplitter(self.ctx.reasoning_parser, self.constrained)
        return self.reasoning[index]

    def _choice_chunks(self, c) -> list[ChatCompletionStreamResponse]:
        """The chunks of one step's output of choice c (reasoning, content or tool-call
        deltas, and the finish chunk when it ends)."""
        out, lp, shaper = [], self.lp_block(c), self.tool_output(c.index)
        thinking, text = "", c.text
        split = self.splitter(c.index)
        if split is not None:
            thinking, text = split.feed(c.text)
            if c.finish_reason is not None:
                more = split.flush()
                thinking, text = thinking + more[0], text + more[1]
        deltas = [DeltaMessage(reasoning_content=thinking)] if thinking else []
        if shaper is None:
            deltas += [DeltaMessage(content=text)] if text else []
        else:
            deltas += shaper.deltas(text)
        if not deltas and lp is not None and lp.content:
            deltas = [DeltaMessage()]  # the logprobs of text held back
        out += [self.one(c.index, d, lp if j == 0 else None) for j, d in enumerate(deltas)]
        if c.finish_reason is not None:
            finish = c.finish_reason
            if shaper is not None:
                last, finish = shaper.end(finish)
                out += [self.one(c.index, d) for d in last]
            out.append(self.one(c.index, DeltaMessage(), None, finish, c.stop_reason))
        return out

    async def collect(self) -> dict:
        choices: dict[int, ChatCompletionResponseChoice] = {}
        k, echo = self.k, self.echo
        async for _, out in self.batch.merged():
            self.usage.add(out)
            for c in out.outputs:
                ch = choices.get(c.index)
                if ch is None:
                    ch = choices[c.index] = ChatCompletionResponseChoice(
                        index=c.index, message=ChatMessage(role=self.role, content=echo),
                        logprobs=None if k is None else ChatCompletionLogProbs(content=[]))
                ch.message.content += c.text
                if k is not None:
                    ch.logprobs.content += self.lp_block(c).content
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        for i, ch in choices.items():
            if self.ctx.reasoning_parser is not None:  # the <think> block apart, before tools
                gen = ch.message.content[len(echo):]
                ch.message.reasoning_content, content = reasoning_split(
                    self.ctx.reasoning_parser, gen, self.constrained)
                ch.message.content = echo + (content or "")
            shaper = self.tool_output(i)
            if shaper is not None:  # the generated text (after the echo) holds the calls
                content, ch.message.tool_calls, ch.finish_reason = shaper.message(
                    ch.message.content[len(echo):], ch.finish_reason)
                ch.message.content = echo + content if content is not None else (echo or None)
            if ch.message.reasoning_content and not ch.message.content:
                ch.message.content = None  # all of it was reasoning (vLLM: content null)
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.ctx.model_name,
                                      usage=self.usage.info(),
                                      choices=[choices[i] for i in sorted(choices)]).model_dump()
