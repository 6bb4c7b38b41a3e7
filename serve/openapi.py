"""What /openapi.json says each route answers: every status code and content type the server
really sends, so generated clients and schema-driven tests see the truth.

Errors of every route are OpenAI error bodies (`ErrorResponse`, application/json): 400 (a bad
field; request validation included, which FastAPI would otherwise document as 422), 401 (/v1
routes when --api-key is set), 404 (a model name this server does not serve), 413 (a body above
10 MiB, any route), 503 (the engine is warming up or stopped). Successes: JSON bodies, or
text/event-stream for `stream: true`, an empty body for /health and Prometheus text for /metrics.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serve.protocol_responses import ErrorResponse

_WHY = {400: "A bad request field (the error names it as `param`)",
        401: "Missing or wrong API key (only when the server runs with --api-key)",
        404: "The model named in the request is not the one this server serves",
        413: "The request body is above 10 MiB",
        500: "An internal error (a bug: the request failed, the server goes on serving)",
        503: "The engine is warming up (or has stopped)"}


def errors(*codes: int) -> dict:
    """FastAPI `responses=` entries: an ErrorResponse body for each status code (413 and
    the catch-all 500 always)."""
    return {c: {"model": ErrorResponse, "description": _WHY[c]} for c in sorted({*codes, 413, 500})}


def ok(model, extra_content: dict | None = None) -> dict:
    """A documented 200 with `model` as its JSON body (and, say, SSE for streams); routes
    return plain dicts, so no response_model re-validates what they send."""
    entry = {"model": model, "description": "Success"}
    if extra_content:
        entry["content"] = extra_content
    return {200: entry}


SSE = {"text/event-stream": {"schema": {"type": "string", "description": (
    "with stream: true, Server-Sent Events: `data: {chunk JSON}` lines, then `data: [DONE]`")}}}
HEALTH_OK = {200: {"description": "Ready (empty body, no content type)", "content": {}}}
HTML = {200: {"description": "The live page of the KV cache (static HTML and JS, no CDN)",
              "content": {"text/html": {"schema": {"type": "string"}}}}}
PROMETHEUS = {200: {"description": "Prometheus text exposition format",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}


def install_openapi(app: FastAPI) -> None:
    """Generate the schema once, without FastAPI's 422 entries (validation errors are
    answered 400 with an error body, see serve/errors.py)."""

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=__doc__.split("\n\n")[1].replace("\n", " "))
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    responses = op.get("responses", {})
                    responses.pop("422", None)
                    for code, r in responses.items():  # errors are JSON on every route
                        content = r.get("content", {})
                        if not code.startswith("2") and "application/json" not in content and content:
                            r["content"] = {"application/json": next(iter(content.values()))}
            comps = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                comps.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
