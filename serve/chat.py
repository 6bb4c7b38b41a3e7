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
from serve.structured import relabel, request_constraint
from serve.tools import ToolOutput, template_tools, tool_constraint, tool_mode
from serve.streams import RequestBatch, SSEResponse, check_unsupported, collect_or_abort, sse_events
from serve.usage import UsageAccumulator


def render_chat(tokenizer, req, chat_template: str | None = None) -> dict:
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
    prompt = render_chat(tok, req, ctx.chat_template)
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
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    batch = RequestBatch(ctx.engine, rid)
    try:
        batch.add([prompt], params)
    except APIError as e:
        raise relabel(e, field) from e
    created, usage = int(time.time()), UsageAccumulator()
    tools = {}  # choice index -> ToolOutput (tool calls parsed from its text)

    def tool_output(index: int) -> ToolOutput | None:
        if mode == "none":
            return None
        return tools.setdefault(index, ToolOutput(mode, req))

    def lp_block(c) -> ChatCompletionLogProbs | None:
        if k is None:
            return None
        return ChatCompletionLogProbs(content=_logprob_content(c.logprobs or [], c.token_ids, k))

    if req.stream:
        def chunk(choices, usage_info: UsageInfo | None = None) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=rid, created=created, model=ctx.model_name,
                                                choices=choices, usage=usage_info)

        def one(index, delta: DeltaMessage, logprobs=None, finish=None, stop_reason=None):
            return chunk([ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                             finish_reason=finish, stop_reason=stop_reason)])

        async def chunks():
            # OpenAI's order per choice: the role, then content chunks (finish_reason null),
            # then one chunk with an empty delta that carries the finish_reason.
            started = set()
            async for _, out in batch.merged():
                usage.add(out)
                for c in out.outputs:
                    if c.index not in started:
                        started.add(c.index)
                        yield one(c.index, DeltaMessage(role=role, content=""))
                        if echo:
                            yield one(c.index, DeltaMessage(content=echo))
                    lp = lp_block(c)
                    shaper = tool_output(c.index)
                    if shaper is None:
                        deltas = [DeltaMessage(content=c.text)] if c.text else []
                    else:
                        deltas = shaper.deltas(c.text)
                    if not deltas and lp is not None and lp.content:
                        deltas = [DeltaMessage()]  # the logprobs of text held back
                    for j, d in enumerate(deltas):
                        yield one(c.index, d, lp if j == 0 else None)
                    if c.finish_reason is not None:
                        finish = c.finish_reason
                        if shaper is not None:
                            last, finish = shaper.end(finish)
                            for d in last:
                                yield one(c.index, d)
                        yield one(c.index, DeltaMessage(), None, finish, c.stop_reason)
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage.info())
        return SSEResponse(sse_events(batch, chunks()))

    async def collect():
        choices: dict[int, ChatCompletionResponseChoice] = {}
        async for _, out in batch.merged():
            usage.add(out)
            for c in out.outputs:
                ch = choices.get(c.index)
                if ch is None:
                    ch = choices[c.index] = ChatCompletionResponseChoice(
                        index=c.index, message=ChatMessage(role=role, content=echo),
                        logprobs=None if k is None else ChatCompletionLogProbs(content=[]))
                ch.message.content += c.text
                if k is not None:
                    ch.logprobs.content += lp_block(c).content
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
        for i, ch in choices.items():
            shaper = tool_output(i)
            if shaper is not None:  # the generated text (after the echo) holds the calls
                content, ch.message.tool_calls, ch.finish_reason = shaper.message(
                    ch.message.content[len(echo):], ch.finish_reason)
                ch.message.content = echo + content if content is not None else (echo or None)
        return ChatCompletionResponse(id=rid, created=created, model=ctx.model_name, usage=usage.info(),
                                      choices=[choices[i] for i in sorted(choices)]).model_dump()

    return await collect_or_abort(raw, batch, collect())
