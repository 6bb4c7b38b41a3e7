"""POST /v1/chat/completions (OpenAI's chat completions API, as vLLM serves it).

The messages are rendered with the model's chat template (transformers'
apply_chat_template, add_generation_prompt=True) and tokenized without adding special
tokens again. max_completion_tokens wins over max_tokens; with neither, a request may
generate what is left of max_model_len after its prompt.
"""

from __future__ import annotations

import time
import uuid

from serve.context import OUTPUT_KIND, ServerContext
from serve.errors import APIError, bad_request
from serve.protocol import ChatCompletionRequest
from serve.streams import RequestBatch, SSEResponse, check_unsupported, collect_or_abort, sse_events


def render_chat(tokenizer, messages, add_generation_prompt: bool = True, kwargs=None) -> dict:
    """Chat messages -> {"prompt": text, "prompt_token_ids": ids}; APIError 400 if empty or
    the template rejects them."""
    if not messages:
        raise APIError("messages must not be empty", 400, "messages")
    convo = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
             for m in messages]
    try:
        text = tokenizer.apply_chat_template(convo, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(kwargs or {}))
    except Exception as e:  # jinja2 errors raised by the template itself (e.g. bad roles)
        raise APIError(f"messages: the chat template rejected them: {e}", 400, "messages") from e
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _logprob_content(entries, token_ids, k: int) -> list[dict]:
    out = []
    for tid, d in zip(token_ids, entries):
        lp = d[tid]
        top = sorted(d.values(), key=lambda x: x.rank or 0)[:k]
        out.append({"token": lp.decoded_token, "logprob": lp.logprob,
                    "bytes": list((lp.decoded_token or "").encode()),
                    "top_logprobs": [{"token": x.decoded_token, "logprob": x.logprob,
                                      "bytes": list((x.decoded_token or "").encode())} for x in top]})
    return out


async def create_chat_completion(req: ChatCompletionRequest, ctx: ServerContext, raw):
    ctx.check_model(req.model)
    check_unsupported(req)
    tok = ctx.engine.get_tokenizer()
    prompt = render_chat(tok, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    k = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
    try:
        params = req.sampling_params(req.max_completion_tokens or req.max_tokens, k)
    except ValueError as e:
        raise bad_request(e) from e
    params.output_kind = OUTPUT_KIND
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

        async def chunks():
            started = set()
            async for _, out in batch.merged():
                count(out)
                for c in out.outputs:
                    if c.index not in started:
                        started.add(c.index)
                        yield {**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]}
                    yield {**chunk, "choices": [{"index": c.index, "delta": {"content": c.text} if c.text else {},
                                                 "logprobs": lp_block(c), "finish_reason": c.finish_reason,
                                                 "stop_reason": c.stop_reason}]}
            if req.stream_options and req.stream_options.include_usage:
                yield {**chunk, "choices": [], "usage": usage_body()}
        return SSEResponse(sse_events(batch, chunks()))

    async def collect():
        choices: dict[int, dict] = {}
        async for _, out in batch.merged():
            count(out)
            for c in out.outputs:
                ch = choices.setdefault(c.index, {"index": c.index, "message": {"role": "assistant", "content": ""},
                                                  "logprobs": None if k is None else {"content": []},
                                                  "finish_reason": None, "stop_reason": None})
                ch["message"]["content"] += c.text
                if k is not None:
                    ch["logprobs"]["content"] += lp_block(c)["content"]
                ch["finish_reason"], ch["stop_reason"] = c.finish_reason, c.stop_reason
        return {**base, "object": "chat.completion", "choices": [choices[i] for i in sorted(choices)],
                "usage": usage_body()}

    return await collect_or_abort(raw, batch, collect())
