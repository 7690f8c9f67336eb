"""Pure ASGI middleware around the app (nothing here parses a body for a route).

    RequestLogMiddleware (outermost)   logs every 4xx/5xx: method, route, status, error message;
                                       with --log-requests also each request's body (truncated)
    GuardMiddleware                    the API key (401) and the body-size limit (413), before
                                       FastAPI reads anything; treats any POST body as JSON

The prompt never reaches the log unless --log-requests is on: error lines carry only the error
message of the OpenAI error body.
"""

from __future__ import annotations

import hmac
import logging

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body

logger = logging.getLogger("radixlm.http")

OPEN_PATHS = ("/health", "/metrics")
LOGGED_BODY_CHARS = 2000      # --log-requests: how much of a request body goes into the log


class GuardMiddleware:
    """The API key check and the body-size limit, before FastAPI reads anything."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            await send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            too_big = f"The request body is larger than --max-request-bytes ({self.max_request_bytes} bytes)"
            declared = headers.get(b"content-length", b"0")
            if declared.isdigit() and int(declared) > self.max_request_bytes:
                await send_error(send, 413, too_big, code="request_too_large")
                return
            body = await self._read_body(receive)
            if body is None:
                await send_error(send, 413, too_big, code="request_too_large")
                return
            receive = _replay(body, receive)
            scope = _as_json(scope, headers)
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        value = headers.get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (the rest is not read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


class RequestLogMiddleware:
    """Logs each error response as `HTTP 400 POST /generate: <message>` (WARNING for 4xx, ERROR
    for 5xx). With `log_requests`, also logs every request's method, route and body at INFO."""

    def __init__(self, app: ASGIApp, log_requests: bool = False):
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = f"{scope['method']} {scope['path']}"
        if self.log_requests:
            receive = self._logging_receive(route, receive)
        status = 0
        body = bytearray()

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < 65536:
                body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    log_error_response(route, status, bytes(body))
            await send(message)

        await self.app(scope, receive, send_and_watch)

    def _logging_receive(self, route: str, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "http.request" and message.get("body"):
                text = message["body"][:LOGGED_BODY_CHARS].decode("utf-8", "replace")
                logger.info("request %s: %s", route, text)
            return message

        return wrapped


def log_error_response(route: str, status: int, body: bytes) -> None:
    """One log line for an error response; the message comes from the OpenAI error body."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except Exception:  # noqa: BLE001 - not our error body: no message to show
        message = "(no error message)"
    logger.log(logging.ERROR if status >= 500 else logging.WARNING, "HTTP %d %s: %s", status, route, message)


def _as_json(scope: Scope, headers: dict[bytes, bytes]) -> Scope:
    """Every POST route takes JSON: treat a body sent without a JSON content type (`curl -d`) as JSON."""
    if b"json" in headers.get(b"content-type", b"").lower():
        return scope
    raw = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    return {**scope, "headers": raw + [(b"content-type", b"application/json")]}


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()   # later calls: http.disconnect when the client goes away

    return replay


async def send_error(send: Send, status: int, message: str, code: str,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answers with the OpenAI error body, from middleware (outside FastAPI's handlers)."""
    body = orjson.dumps(error_body(status, message, code=code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
