"""POST /v1/completions (OpenAI's legacy completions API, as vLLM serves it).

prompt: a string, a list of strings, a list of token ids, or a list of such lists; each prompt
is one engine request with n samples, and choice index = prompt index * n + sample index.
echo prepends the prompt (with logprobs, the prompt's logprobs come from prompt_logprobs).
echo with max_tokens=0 answers the prompt alone, with its logprobs (OpenAI's way to score a
text, as vLLM serves it): the engine request generates one token that is not shown, so
SamplingParams itself keeps refusing max_tokens=0; usage counts that token, as vLLM's does.
"""

from __future__ import annotations

import codecs
import time
import uuid

from serve.chat import token_bytes
from serve.context import OUTPUT_KIND, ServerContext
from serve.errors import APIError, bad_request
from serve.protocol import CompletionRequest
from serve.protocol_responses import (CompletionLogProbs, CompletionResponse, CompletionResponseChoice,
                                      CompletionStreamResponse, UsageInfo)
from serve.response_format import relabel, request_constraint
from serve.streams import RequestBatch, SSEResponse, check_unsupported, collect_or_abort, sse_events
from serve.usage import UsageAccumulator, continuous_usage


def _prompts(req: CompletionRequest, tokenizer) -> list:
    p = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not p:
        raise APIError("prompt must not be empty", 400, "prompt")
    if isinstance(p[0], int):
        return [{"prompt_token_ids": list(p)}]
    if isinstance(p[0], list):
        return [{"prompt_token_ids": list(x)} for x in p]
    if not req.add_special_tokens:  # as vLLM: no BOS (or other special tokens) added
        try:
            return [{"prompt": x, "prompt_token_ids": tokenizer.encode(x, add_special_tokens=False)} for x in p]
        except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate
            raise APIError(f"prompt: the text cannot be encoded ({e})"[:300], 400, "prompt") from e
    return list(p)


class _TextOffset:
    """The character offset of the next token in a choice's text, carried across chunks. Each
    token's bytes go through a UTF-8 decoder, so tokens holding parts of one character
    (`bytes:\\xNN...`) advance the offset by that character once it is complete."""

    def __init__(self):
        self.chars, self._utf8 = 0, codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, shown: str) -> int:
        """The offset of a token shown as `shown`; moves past it. A whole token that follows
        an unfinished character starts after that character's U+FFFD."""
        decoded = self._utf8.decode(bytes(token_bytes(shown)))
        at = self.chars
        if not shown.startswith("bytes:") and decoded.endswith(shown):
            at += len(decoded) - len(shown)
        self.chars += len(decoded)
        return at


def _logprobs_block(entries, token_ids, offset: _TextOffset, k: int | None, token_text) -> CompletionLogProbs:
    """OpenAI completions logprobs of these tokens, their text continuing at `offset`
    (advanced here).
    Tokens are shown by their Logprob.decoded_token, unique per token: a token that holds
    part of a character reads `bytes:\\xNN...` (as vLLM), so no top_logprobs entry is lost
    to another with the same text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, d in zip(token_ids, entries):
        if d is None:  # the first prompt token has no logprob (vLLM: its text, then nulls)
            tokens.append(token_text(tid))
            token_lps.append(None)
            tops.append(None)
        else:
            lp = d[tid]
            tokens.append(lp.decoded_token)
            token_lps.append(lp.logprob)
            top = sorted(d.values(), key=lambda x: x.rank or 0)
            tops.append({x.decoded_token: x.logprob for x in top[: (k or 0) + 1]})
        offsets.append(offset.take(tokens[-1] or ""))
    return CompletionLogProbs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                              text_offset=offsets)


async def create_completion(req: CompletionRequest, ctx: ServerContext, raw):
    run = _prepare(req, ctx)
    if req.stream:
        return SSEResponse(sse_events(run.batch, run.chunks()))
    return await collect_or_abort(raw, run.batch, run.collect())


def _prepare(req: CompletionRequest, ctx: ServerContext) -> "_CompletionRun":
    """Check the request (APIError 4xx naming the field), tokenize and queue its prompts."""
    ctx.check_model(req.model)
    check_unsupported(req)
    if req.suffix:
        raise APIError("suffix is not supported", 400, "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(f"best_of must equal n ({req.n}), got {req.best_of}", 400, "best_of")
    prompts = _prompts(req, ctx.engine.get_tokenizer())
    constraint, field = request_constraint(req)
    echo_only = req.echo and req.max_tokens == 0
    if echo_only and req.min_tokens:
        raise APIError(f"min_tokens must be 0 with echo and max_tokens=0 (nothing is generated), "
                       f"got {req.min_tokens}", 400, "min_tokens")
    try:
        params = req.sampling_params(1 if echo_only else req.max_tokens, req.logprobs,
                                     req.logprobs if req.echo and req.logprobs is not None else None,
                                     structured_outputs=constraint)
    except ValueError as e:
        raise bad_request(e) from e
    params.output_kind = OUTPUT_KIND
    batch = RequestBatch(ctx.engine, f"cmpl-{uuid.uuid4().hex}")
    try:
        batch.add(prompts, params)
    except APIError as e:
        if echo_only and e.message.startswith("prompt length"):  # the hidden token needs room
            raise APIError(e.message + "; echo with max_tokens=0 scores prompts of at most "
                           "max_model_len - 1 tokens", e.status, e.param) from e
        raise relabel(e, field) from e
    return _CompletionRun(req, ctx, batch)


class _CompletionRun:
    """A queued completion request (its prompts x n choices): its stream of chunks, or its
    collected response."""

    def __init__(self, req: CompletionRequest, ctx: ServerContext, batch: RequestBatch):
        self.req, self.ctx, self.batch = req, ctx, batch
        self.rid, self.created, self.n = batch.base_id, int(time.time()), req.n
        tok = ctx.engine.get_tokenizer()
        self.token_text = ctx.engine.engine.output_processor.token_text
        self.prompt_text = [pr.prompt if pr.prompt is not None else tok.decode(pr.prompt_token_ids)
                            for pr in batch.processed]
        self.echo_only = req.echo and req.max_tokens == 0  # the prompt alone, nothing generated
        self.echoed: set[int] = set()   # choice indexes whose first output was shaped
        self.prompt_lp: dict = {}       # prompt index -> its prompt logprobs
        self.offset: dict = {}          # choice index -> its _TextOffset
        self.usage = UsageAccumulator(continuous_usage(req))

    def choice(self, i, out, c) -> CompletionResponseChoice:
        """Choice c of prompt i's output, with the echoed prompt (and its logprobs) first."""
        req = self.req
        idx = i * self.n + c.index
        first = idx not in self.echoed
        self.echoed.add(idx)
        if out.prompt_logprobs is not None:
            self.prompt_lp[i] = out.prompt_logprobs
        shown = "" if self.echo_only else c.text
        text, lp = (self.prompt_text[i] + shown if req.echo and first else shown), None
        if req.logprobs is not None:
            ids, entries = ([], []) if self.echo_only else (list(c.token_ids), list(c.logprobs or []))
            if req.echo and first and i in self.prompt_lp:
                ids = list(out.prompt_token_ids) + ids
                entries = list(self.prompt_lp[i]) + entries
            lp = _logprobs_block(entries, ids, self.offset.setdefault(idx, _TextOffset()),
                                 req.logprobs, self.token_text)
        return CompletionResponseChoice(index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason)

    def chunk(self, choices, usage_info: UsageInfo | None = None) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.rid, created=self.created, model=self.ctx.model_name,
                                        choices=choices, usage=usage_info)

    async def chunks(self):
        """OpenAI's order per choice: text chunks (finish_reason null), then one chunk with
        empty text that carries the finish_reason; usage last if asked."""
        async for i, out in self.batch.merged():
            self.usage.add(out)
            for c in out.outputs:
                ch = self.choice(i, out, c)
                used = self.usage.so_far(out.request_id, c.index)  # continuous usage stats
                if ch.text or (ch.logprobs is not None and ch.logprobs.tokens):
                    yield self.chunk([ch.model_copy(update={"finish_reason": None, "stop_reason": None})],
                                     used)
                if ch.finish_reason is not None:
                    yield self.chunk([CompletionResponseChoice(
                        index=ch.index, text="", finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)],
                        used)
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self.chunk([], self.usage.info())

    async def collect(self) -> dict:
        texts: dict[int, CompletionResponseChoice] = {}
        async for i, out in self.batch.merged():
            self.usage.add(out)
            for c in out.outputs:
                ch = self.choice(i, out, c)
                prev = texts.get(ch.index)
                if prev is None:
                    texts[ch.index] = ch
                    continue
                prev.text += ch.text
                prev.finish_reason, prev.stop_reason = ch.finish_reason, ch.stop_reason
                if ch.logprobs is not None:
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(prev.logprobs, key).extend(getattr(ch.logprobs, key))
        return CompletionResponse(id=self.rid, created=self.created, model=self.ctx.model_name,
                                  usage=self.usage.info(),
                                  choices=[texts[k] for k in sorted(texts)]).model_dump()
