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
from serve.streams import RequestBatch, SSEResponse, check_unsupported, collect_or_abort, sse_events


def render_chat(tokenizer, req) -> dict:
    """The request's messages -> {"prompt": text, "prompt_token_ids": ids} (jaxkv.chat_utils:
    control tokens only from the template); APIError 400 naming the field if a message or
    the template's options are bad."""
    if not req.messages:
        raise APIError("messages must not be empty", 400, "messages")
    for i, m in enumerate(req.messages):
        if m.tool_calls:
            raise APIError(f"messages[{i}].tool_calls: tool calls are not supported yet", 400,
                           f"messages[{i}].tool_calls")
    kwargs = dict(req.chat_template_kwargs or {})
    if getattr(req, "documents", None):
        kwargs["documents"] = req.documents
    try:
        text, ids = chat_utils.render_chat(
            tokenizer, [m.as_dict() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, chat_template_kwargs=kwargs)
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


def _logprob_content(entries, token_ids, k: int) -> list[dict]:
    out = []
    for tid, d in zip(token_ids, entries):
        lp = d[tid]
        top = sorted(d.values(), key=lambda x: x.rank or 0)[:k]
        out.append({"token": lp.decoded_token, "logprob": lp.logprob,
                    "bytes": token_bytes(lp.decoded_token),
                    "top_logprobs": [{"token": x.decoded_token, "logprob": x.logprob,
                                      "bytes": token_bytes(x.decoded_token)} for x in top]})
    return out


async def create_chat_completion(req: ChatCompletionRequest, ctx: ServerContext, raw):
    ctx.check_model(req.model)
    check_unsupported(req, chat=True)
    tok = ctx.engine.get_tokenizer()
    prompt = render_chat(tok, req)
    k = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
    try:
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, k)
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
    batch.add([prompt], params)
    created, usage = int(time.time()), {}

    def lp_block(c):
        if k is None:
            return None
        return {"content": _logprob_content(c.logprobs or [], c.token_ids, k)}

    def count(out):
        if out.finished:
            p = len(out.prompt_token_ids)
            usage.update(prompt_tokens=p, prompt_tokens_details={"cached_tokens": out.num_cached_tokens})
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + sum(len(c.token_ids) for c in out.outputs)

    def usage_body():
        p, c = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": usage.get("prompt_tokens_details", {"cached_tokens": 0})}

    base = {"id": rid, "created": created, "model": ctx.model_name}
    if req.stream:
        chunk = {**base, "object": "chat.completion.chunk"}

        def one(index, delta, logprobs=None, finish=None, stop_reason=None):
            return {**chunk, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                          "finish_reason": finish, "stop_reason": stop_reason}]}

        async def chunks():
            # OpenAI's order per choice: the role, then content chunks (finish_reason null),
            # then one chunk with an empty delta that carries the finish_reason.
            started = set()
            async for _, out in batch.merged():
                count(out)
                for c in out.outputs:
                    if c.index not in started:
                        started.add(c.index)
                        yield one(c.index, {"role": role, "content": ""})
                        if echo:
                            yield one(c.index, {"content": echo})
                    lp = lp_block(c)
                    if c.text or (lp and lp["content"]):
                        yield one(c.index, {"content": c.text} if c.text else {}, lp)
                    if c.finish_reason is not None:
                        yield one(c.index, {}, None, c.finish_reason, c.stop_reason)
            if req.stream_options and req.stream_options.include_usage:
                yield {**chunk, "choices": [], "usage": usage_body()}
        return SSEResponse(sse_events(batch, chunks()))

    async def collect():
        choices: dict[int, dict] = {}
        async for _, out in batch.merged():
            count(out)
            for c in out.outputs:
                ch = choices.setdefault(c.index, {"index": c.index, "message": {"role": role, "content": echo},
                                                  "logprobs": None if k is None else {"content": []},
                                                  "finish_reason": None, "stop_reason": None})
                ch["message"]["content"] += c.text
                if k is not None:
                    ch["logprobs"]["content"] += lp_block(c)["content"]
                ch["finish_reason"], ch["stop_reason"] = c.finish_reason, c.stop_reason
        return {**base, "object": "chat.completion", "choices": [choices[i] for i in sorted(choices)],
                "usage": usage_body()}

    return await collect_or_abort(raw, batch, collect())
