"""The HTTP server: SGLang's native routes, the OpenAI routes, /metrics, and `launch_server`.

    create_app(tokenizer_manager, server_args, metrics, chat_template) -> FastAPI
    launch_server(server_args)   # blocks: children, uvicorn (uvloop), readiness log, clean exit

Every error answers with the OpenAI error body (errors.py). GuardMiddleware runs before any
parsing: it refuses bodies over `--max-request-bytes` (413) and, with `--api-key`, requests
without `Authorization: Bearer KEY` (401) on every route but /health and /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import radixlm
from radixlm.runtime.entrypoints.chat_template import JinjaChatTemplate, resolve_chat_template
from radixlm.runtime.entrypoints.dashboard import add_dashboard_routes
from radixlm.runtime.entrypoints.errors import (
    APIError,
    error_body,
    install_error_handlers,
    raise_if_rejected,
    to_api_error,
)
from radixlm.runtime.entrypoints.openai_api import OpenAIServing
from radixlm.runtime.entrypoints.openai_format import DONE, SSEResponse, sse
from radixlm.runtime.entrypoints.openai_protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from radixlm.runtime.managers.generate_fields import UnsupportedFieldError, check_extra_fields
from radixlm.runtime.managers.io_struct import GenerateReqInput
from radixlm.runtime.metrics import MetricsCollector
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")
HEALTH_TIMEOUT_S = 20.0
STATE_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------- guard middleware
class GuardMiddleware:
    """Pure ASGI: the API key check and the body-size limit, before FastAPI reads anything."""

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
            await _send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            too_big = f"The request body is larger than --max-request-bytes ({self.max_request_bytes} bytes)"
            declared = headers.get(b"content-length", b"0")
            if declared.isdigit() and int(declared) > self.max_request_bytes:
                await _send_error(send, 413, too_big, code="request_too_large")
                return
            body = await self._read_body(receive)
            if body is None:
                await _send_error(send, 413, too_big, code="request_too_large")
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


async def _send_error(send: Send, status: int, message: str, code: str,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps(error_body(status, message, code=code))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------- app
def create_app(tokenizer_manager: Any, server_args: ServerArgs, metrics: MetricsCollector,
               chat_template: JinjaChatTemplate | None = None) -> FastAPI:
    """Builds the FastAPI app around a running TokenizerManager."""
    template = chat_template or resolve_chat_template(server_args.chat_template, tokenizer_manager.tokenizer)
    app = FastAPI(title="radixlm", version=radixlm.__version__)
    app.state.server = ServerState(tokenizer_manager, server_args, metrics,
                                   OpenAIServing(tokenizer_manager, server_args.model_name,
                                                 server_args.model_path or "", template,
                                                 server_args.tool_call_parser, server_args.reasoning_parser))
    install_error_handlers(app)
    _add_native_routes(app, app.state.server)
    _add_openai_routes(app, app.state.server.openai)
    add_dashboard_routes(app, tokenizer_manager)
    app.add_middleware(GuardMiddleware, api_key=server_args.api_key,
                       max_request_bytes=server_args.max_request_bytes)
    return app


@dataclasses.dataclass
class ServerState:
    tm: Any
    server_args: ServerArgs
    metrics: MetricsCollector
    openai: OpenAIServing
    started_at: float = dataclasses.field(default_factory=time.time)
    failure: str | None = None      # set when a child died: /health turns 503

    def capacity(self) -> dict[str, Any]:
        return capacity_report(self.tm.scheduler_info, self.tm.context_len)

    async def server_info(self) -> dict[str, Any]:
        args = dataclasses.asdict(self.server_args)
        args["api_key"] = None if self.server_args.api_key is None else "<redacted>"
        stats = self.tm.latest_stats
        try:
            state = await asyncio.wait_for(self.tm.get_internal_state(), STATE_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as e:
            state = {"error": f"scheduler state unavailable: {e!r}"}
        return {**args, **self.tm.scheduler_info, **self.capacity(), "version": radixlm.__version__,
                "scheduler_stats": dataclasses.asdict(stats) if stats is not None else None,
                "internal_states": [state], "num_running_requests": self.tm.num_running_requests(),
                "uptime_s": time.time() - self.started_at}


def capacity_report(info: dict[str, Any], context_len: int) -> dict[str, Any]:
    """The figures printed at startup and returned by /get_server_info."""
    max_total = int(info.get("max_total_tokens") or 0)
    per_token = int(info.get("kv_bytes_per_token") or 0)
    return {"kv_bytes_per_token": per_token, "max_total_tokens": max_total, "context_len": context_len,
            "kv_pool_bytes": per_token * max_total,
            "max_concurrent_requests_at_context": max_total // context_len if context_len else 0,
            "max_running_requests": info.get("max_running_requests")}


def format_capacity(cap: dict[str, Any]) -> list[str]:
    """The startup capacity report: one line."""
    return [f"KV cache: {cap['max_total_tokens']} tokens ({cap['kv_pool_bytes'] / 2**20:.1f} MiB, "
            f"{cap['kv_bytes_per_token']} bytes per token); context length {cap['context_len']}: at most "
            f"{cap['max_concurrent_requests_at_context']} concurrent requests at full context "
            f"(max running requests: {cap['max_running_requests']})"]


async def health_generate(tm: Any, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """Runs a 1-token generation; returns None when it worked, else what went wrong."""
    obj = GenerateReqInput(input_ids=[0], rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                           sampling_params={"max_new_tokens": 1, "temperature": 0.0})

    async def one() -> None:
        stream = tm.generate(obj)
        try:
            await stream.__anext__()
        finally:
            await stream.aclose()

    try:
        await asyncio.wait_for(one(), timeout)
    except asyncio.TimeoutError:
        return f"no generation within {timeout:.0f} s"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _add_native_routes(app: FastAPI, st: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if st.failure:
            raise APIError(503, f"Unhealthy: {st.failure}")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_gen() -> Response:
        problem = st.failure or await health_generate(st.tm)
        if problem:
            raise APIError(503, f"Unhealthy: {problem}")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> Response:
        info = st.tm.scheduler_info
        return _json({"model_path": st.server_args.model_path, "tokenizer_path": st.server_args.tokenizer_path,
                      "is_generation": bool(info.get("is_generation", True)),
                      "served_model_name": st.server_args.model_name, "max_model_len": st.tm.context_len})

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Response:
        return _json(await st.server_info())

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        running = st.tm.num_running_requests()
        if running:
            raise APIError(400, f"Cannot flush the cache while {running} request(s) are running")
        out = await st.tm.flush_cache()
        if not out.success:
            raise APIError(400, out.message or "Cache flush refused")
        return _json({"success": True, "message": out.message or "Cache flushed."})

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        if not body.rid and not body.abort_all:
            raise APIError(400, "abort_request needs 'rid' (or 'abort_all': true)", param="rid")
        st.tm.abort_request("" if body.abort_all else body.rid)
        return _json({"success": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=st.metrics.content_type)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await _generate(st, body, request)


async def _generate(st: ServerState, body: GenerateRequest, request: Request) -> Response:
    extra = body.model_extra or {}
    try:
        check_extra_fields(extra)
    except UnsupportedFieldError as e:
        raise APIError(400, str(e), param=e.field) from None
    fields = body.model_dump(exclude=set(extra))
    obj = GenerateReqInput(**fields)
    stream = st.tm.generate(obj, request)
    try:
        first = await stream.__anext__()
        raise_if_rejected(first)
    except StopAsyncIteration:
        raise APIError(500, "The request produced no output") from None
    except Exception as e:
        await stream.aclose()
        raise to_api_error(e) from None
    if not body.stream:
        await stream.aclose()
        return _json(first)

    async def events() -> Any:
        try:
            yield sse(first)
            async for item in stream:
                yield sse(item)
        except Exception as e:
            err = to_api_error(e)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        finally:
            await stream.aclose()
        yield DONE

    return SSEResponse(events())


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(serving.list_models())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        return _json(serving.retrieve_model(model_id))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completions(body, request)


# ---------------------------------------------------------------------- launch
def launch_server(server_args: ServerArgs) -> None:
    """Starts the children and serves HTTP until SIGINT/SIGTERM or a child dies; then exits."""
    from radixlm.runtime.entrypoints.server_lifecycle import run_server

    run_server(server_args)
