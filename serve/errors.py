"""OpenAI-style error bodies, and the handlers that turn every client mistake into a 4xx.

Body (protocol_responses.ErrorResponse: OpenAI's shape, with vLLM's type names and the status
code as `code`):
    {"error": {"message": str, "type": "BadRequestError" | ..., "param": str | null, "code": int}}
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.protocol_responses import ErrorInfo, ErrorResponse

logger = logging.getLogger("jaxkv")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               422: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """Raised by route code; becomes an error body with this status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "BadRequestError"),
                                         param=param, code=status)).model_dump()


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


_FIELD = re.compile(r"^([a-z_]+)((?:\[\d+\]|\.[a-z_]+)*)")  # top_k, messages[0].content[1]
_ONE_WORD_FIELDS = {"n", "temperature", "seed", "stop", "logprobs", "prompt", "messages", "tokens",
                    "tools"}


def bad_request(e: ValueError) -> APIError:
    """A ValueError from SamplingParams / the engine / chat rendering as a 400; `param` is the
    field its message starts with (those messages name the field first: "top_k must be ...",
    "messages[0].content must be given")."""
    msg = str(e)
    m = _FIELD.match(msg)
    word = m.group(1) if m else ""
    return APIError(msg, 400, word + m.group(2) if "_" in word or word in _ONE_WORD_FIELDS else None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    got = e.get("input")
    shown = "" if e.get("type") == "missing" else f", got {got!r}"[:200]
    return f"{where}: {e.get('msg')}{shown}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(msg, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(f"internal error: {exc!r}", 500)
