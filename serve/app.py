"""The FastAPI app: OpenAI routes (/v1/...), vLLM's /health, /version, /tokenize, /detokenize
and /metrics. `build_app(ctx, metrics)` wires them to a ServerContext; serve/server.py runs it."""

from __future__ import annotations

import asyncio
import hmac
import json
import pathlib

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import jaxkv
from serve.chat import chat_request_prompt, create_chat_completion
from serve.completions import create_completion
from serve.context import ServerContext
from serve.errors import APIError, error_body, install_error_handlers
from serve.openapi import HEALTH_OK, HTML, PROMETHEUS, SSE, errors, install_openapi, ok
from serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from serve.protocol_responses import (ChatCompletionResponse, CompletionResponse, DetokenizeResponse,
                                     KVCacheSnapshot, ModelCard, ModelList, TokenizeResponse,
                                     TokenizerInfoResponse, VersionResponse)
from serve.responses import create_response
from serve.responses_protocol import ResponseObject, ResponsesRequest

MAX_BODY_BYTES = 10 * 1024 * 1024
DASHBOARD_HTML = (pathlib.Path(__file__).parent / "static" / "dashboard.html").read_text(encoding="utf-8")


class GuardMiddleware:
    """Pure ASGI: 401 on /v1 routes without the API key (when one is set); 413 for a request
    body above MAX_BODY_BYTES, by Content-Length or, for chunked bodies, counted while the
    body is read here (it is then replayed to the app)."""

    def __init__(self, app, ctx: ServerContext):
        self.app, self.ctx = app, ctx

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.ctx.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.ctx.api_key}".encode()):
                return await _send_json(send, 401, error_body("invalid or missing API key", 401))
        length = headers.get("content-length")
        if length is not None and length.isdigit():
            if int(length) > MAX_BODY_BYTES:
                return await _send_json(send, 413, error_body(
                    f"request body of {int(length)} bytes is above the limit of {MAX_BODY_BYTES}", 413))
            return await self.app(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, seen = [], 0
        while True:  # a body without Content-Length: read it here, counting
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            if seen > MAX_BODY_BYTES:
                return await _send_json(send, 413, error_body(
                    f"request body is above the limit of {MAX_BODY_BYTES} bytes", 413))
            chunks.append(msg)
            if not msg.get("more_body"):
                break
        replay = iter(chunks)

        async def replay_receive():
            msg = next(replay, None)
            return msg if msg is not None else await receive()

        await self.app(scope, replay_receive, send)


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def build_app(ctx: ServerContext, metrics) -> FastAPI:
    """The app for `ctx` (the engine may arrive later: routes answer 503 until it does);
    `metrics` is the PrometheusStatLogger whose registry /metrics exposes."""
    app = FastAPI(title="jaxkv", version=jaxkv.__version__, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(GuardMiddleware, ctx=ctx)
    _add_status_routes(app, ctx)
    _add_generation_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    _add_cache_and_metrics_routes(app, ctx, metrics)
    return app


def _ready_engine(ctx: ServerContext):
    """The AsyncLLM of `ctx`; APIError 503 until it is ready."""
    if not ctx.ready:
        raise APIError(f"not ready: {ctx.not_ready_reason()}", 503)
    return ctx.engine


def _add_status_routes(app: FastAPI, ctx: ServerContext) -> None:
    """/health, /version and /v1/models."""
    @app.get("/health", response_class=Response, responses={**HEALTH_OK, **errors(503)})
    async def health():
        if not ctx.ready:
            return JSONResponse(error_body(ctx.not_ready_reason(), 503), status_code=503)
        return Response(status_code=200)

    @app.get("/version", responses={**ok(VersionResponse), **errors()})
    async def version():
        return {"version": jaxkv.__version__}

    @app.get("/v1/models", responses={**ok(ModelList), **errors(401)})
    async def models():
        card = ModelCard(id=ctx.model_name, created=ctx.created, root=ctx.model_path or ctx.model_name,
                         max_model_len=ctx.engine.max_model_len if ctx.ready else None)
        return ModelList(data=[card]).model_dump()


def _add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    """/v1/completions and /v1/chat/completions (serve/completions.py, serve/chat.py)."""
    @app.post("/v1/completions", responses={**ok(CompletionResponse, SSE), **errors(400, 401, 404, 503)})
    async def completions(req: CompletionRequest, raw: Request):
        _ready_engine(ctx)
        return await create_completion(req, ctx, raw)

    @app.post("/v1/chat/completions",
              responses={**ok(ChatCompletionResponse, SSE), **errors(400, 401, 404, 503)})
    async def chat(req: ChatCompletionRequest, raw: Request):
        _ready_engine(ctx)
        return await create_chat_completion(req, ctx, raw)

    @app.post("/v1/responses", responses={**ok(ResponseObject, SSE), **errors(400, 401, 404, 503)})
    async def responses(req: ResponsesRequest, raw: Request):
        """OpenAI's Responses API (serve/responses.py)."""
        _ready_engine(ctx)
        return await create_response(req, ctx, raw)

    @app.get("/v1/responses/{response_id}", responses={**ok(ResponseObject), **errors(401, 404)})
    async def get_response(response_id: str):
        """A stored response (the store is off unless --enable-responses-api-store)."""
        found = ctx.response_store.get(response_id) if ctx.response_store is not None else None
        if found is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id")
        return found[0]


def _add_tokenizer_routes(app: FastAPI, ctx: ServerContext) -> None:
    """vLLM's /tokenize (a prompt or chat messages) and /detokenize."""
    @app.post("/tokenize", responses={**ok(TokenizeResponse), **errors(400, 404, 503)})
    async def tokenize(req: TokenizeRequest):
        eng = _ready_engine(ctx)
        ctx.check_model(req.model)
        ids = _token_ids(req, eng.get_tokenizer(), ctx)
        return TokenizeResponse(count=len(ids), max_model_len=eng.max_model_len, tokens=ids).model_dump()

    @app.post("/detokenize", responses={**ok(DetokenizeResponse), **errors(400, 404, 503)})
    async def detokenize(req: DetokenizeRequest):
        eng = _ready_engine(ctx)
        ctx.check_model(req.model)
        vocab = eng.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})", 400, "tokens")
        return DetokenizeResponse(prompt=eng.get_tokenizer().decode(req.tokens)).model_dump()


    if ctx.enable_tokenizer_info_endpoint:  # vLLM's flag: it may show a private template
        @app.get("/tokenizer_info", responses={**ok(TokenizerInfoResponse), **errors(503)})
        async def tokenizer_info():
            """The tokenizer's configuration, as its tokenizer_config.json would hold it."""
            return tokenizer_config(_ready_engine(ctx).get_tokenizer(), ctx.chat_template)


def tokenizer_config(tok, chat_template: str | None) -> dict:
    """vLLM's /tokenizer_info body: the tokenizer's init arguments made JSON (an AddedToken as
    its text), its class as tokenizer_class, and the server's --chat-template if one is set."""
    info = {k: _json_value(v) for k, v in getattr(tok, "init_kwargs", {}).items()}
    info.update(tokenizer_class=type(tok).__name__,
                model_max_length=getattr(tok, "model_max_length", None))
    if chat_template is not None:
        info["chat_template"] = chat_template
    elif getattr(tok, "chat_template", None) is not None:
        info.setdefault("chat_template", tok.chat_template)
    return info


def _json_value(v):
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return getattr(v, "content", None) if hasattr(v, "content") else str(v)  # AddedToken: its text


def _token_ids(req: TokenizeRequest, tok, ctx: ServerContext) -> list[int]:
    """The token ids /tokenize answers: of the prompt, or of the rendered chat messages."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt or messages", 400, "prompt")
    if req.messages is not None:
        return chat_request_prompt(tok, req, ctx.chat_template)["prompt_token_ids"]
    try:
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate
        raise APIError(f"prompt: the text cannot be encoded ({e})"[:300], 400, "prompt") from e


def _add_cache_and_metrics_routes(app: FastAPI, ctx: ServerContext, metrics) -> None:
    """/kv_cache/blocks and /dashboard (the live cache page), /metrics (Prometheus)."""
    @app.get("/kv_cache/blocks", responses={**ok(KVCacheSnapshot), **errors(503)})
    async def kv_cache_blocks():
        """The block pool between two steps: per block its state and ref count, per request
        holding blocks its block table, and the engine's stats (the live page polls it)."""
        snap = await asyncio.to_thread(_ready_engine(ctx).kv_cache_snapshot)
        if snap is None:
            raise APIError(f"not ready: {ctx.not_ready_reason()}", 503)
        return snap

    @app.get("/dashboard", response_class=HTMLResponse, responses={**HTML, **errors()})
    async def dashboard():
        """The live page of the cache: the block pool as a grid, updated every second."""
        return HTMLResponse(DASHBOARD_HTML)

    @app.get("/metrics", response_class=Response, responses={**PROMETHEUS, **errors()})
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
