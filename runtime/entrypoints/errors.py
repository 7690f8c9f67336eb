"""OpenAI-style error bodies and the HTTP status of every failure the server reports.

Every 4xx/5xx the server sends, on the OpenAI and the native routes alike, has the body

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

so the OpenAI SDK maps it onto its exception classes by status (400 BadRequest, 401 Authentication,
404 NotFound, 413, 422 Unprocessable, 429 RateLimit, 503 overloaded). `install_error_handlers` makes
FastAPI's own errors (validation, unknown route, wrong method) use the same shape.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger(__name__)

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error with an HTTP status; raise it anywhere in a route to answer with the OpenAI body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response serialized with orjson (every route's JSON answers go through here)."""
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return json_response(error_body(status, message, param, code), status, headers)


def api_error_response(err: APIError) -> Response:
    return error_response(err.status, err.message, err.param, err.code, err.headers)


def to_api_error(exc: BaseException) -> APIError:
    """Maps an exception raised by the TokenizerManager (or our own code) to a status.

    ValueError/TypeError mean bad input (400); an exception carrying `status_code` (an overload
    error, say) keeps that status; RuntimeError is the TokenizerManager's "the runtime failed" (503);
    anything else is a server fault (500), logged with its traceback.
    """
    if isinstance(exc, APIError):
        return exc
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:
        headers = getattr(exc, "headers", None)
        return APIError(status, str(exc) or type(exc).__name__, headers=headers if isinstance(headers, dict) else None)
    if isinstance(exc, (ValueError, TypeError, KeyError)):
        return APIError(400, _exc_message(exc))
    if isinstance(exc, RuntimeError):   # the TokenizerManager's "the runtime failed" (a child died)
        return APIError(503, str(exc) or "The server is not available", code="server_unavailable")
    logger.error("Internal error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}")


def raise_if_rejected(out: Any) -> None:
    """Raises APIError when a result (dict or list) was aborted with an HTTP status.

    The scheduler rejects some input only after it was sent (an invalid regex or JSON schema found
    while compiling the grammar): the request then finishes as `{"type": "abort", "message",
    "status_code"}`, which the HTTP layer turns into that status.
    """
    for item in out if isinstance(out, list) else [out]:
        reason = (item.get("meta_info") or {}).get("finish_reason") if isinstance(item, dict) else None
        if isinstance(reason, dict) and reason.get("type") == "abort":
            status = reason.get("status_code")
            if isinstance(status, int) and 400 <= status < 600:
                retry = {"Retry-After": "1"} if status in (429, 503) else None
                raise APIError(status, str(reason.get("message") or "Request rejected"), headers=retry)


def _exc_message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return f"Missing or invalid key: {exc.args[0]}"
    return str(exc) or type(exc).__name__


# ----------------------------------------------------------------- results of TokenizerManager.generate
async def only_item(stream: AsyncIterator[Any]) -> Any:
    """The first (for a non-streaming request, the only) item of a TokenizerManager.generate
    stream, which is then closed. Every failure becomes an APIError (see to_api_error)."""
    first = await _first_item(stream)
    await stream.aclose()
    return first


async def start_stream(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The same stream, once its first item came: waiting for it before the 200 goes out makes
    input errors (and a rejection) a 4xx. The returned iterator closes `stream` when it ends."""
    first = await _first_item(stream)

    async def chained() -> AsyncIterator[Any]:
        try:
            yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    return chained()


async def _first_item(stream: AsyncIterator[Any]) -> Any:
    try:
        first = await stream.__anext__()
        raise_if_rejected(first)
    except StopAsyncIteration:
        raise APIError(500, "The request produced no output") from None
    except Exception as e:
        await stream.aclose()
        raise to_api_error(e) from None
    return first


# ----------------------------------------------------------------- FastAPI validation errors
def validation_error_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message (and the offending parameter) from pydantic's error list."""
    if not errors:
        return "Invalid request body", None
    parts: list[str] = []
    param: str | None = None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
        # pydantic names union members in the location ("text.str"); keep only real field names
        loc = [x for x in loc if not _is_type_tag(x)]
        where = ".".join(loc)
        kind = err.get("type", "")
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"Malformed JSON body: {ctx.get('error', err.get('msg', 'invalid JSON'))}", None
        if not where and kind == "missing":
            return "The request body is missing: send a JSON object", None
        if not where and kind in ("model_attributes_type", "dict_type", "model_type"):
            return "The request body must be a JSON object", None
        if kind == "extra_forbidden":
            parts.append(f"Unknown field '{where}'")
        elif kind == "missing":
            parts.append(f"Missing required field '{where}'")
        else:
            parts.append(f"{where}: {err.get('msg', 'invalid value')}" if where else err.get("msg", "invalid"))
        param = param or (where or None)
    if len(errors) > 3:
        parts.append(f"... and {len(errors) - 3} more error(s)")
    return "; ".join(parts), param


def _is_type_tag(segment: str) -> bool:
    return (segment in ("str", "int", "float", "bool", "dict", "list", "function-after", "function-plain")
            or segment.startswith(("list[", "dict[", "constrained-", "function-", "literal[", "lax-", "strict-"))
            or "[" in segment and "]" in segment)


def install_error_handlers(app: FastAPI) -> None:
    """Routes FastAPI's own errors and uncaught exceptions through the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = validation_error_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def _bad_input(_: Request, exc: Exception) -> Response:
        return api_error_response(to_api_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        # starlette re-raises after sending this, so the server log keeps the traceback
        return api_error_response(to_api_error(exc))
