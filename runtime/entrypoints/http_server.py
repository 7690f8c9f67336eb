"""The HTTP app: SGLang's native routes, the OpenAI routes, /metrics, /tokenize, /dashboard.

    create_app(tokenizer_manager, server_args, metrics, chat_template) -> FastAPI

server_lifecycle.run_server starts the children and serves this app with uvicorn.

Every error answers with the OpenAI error body (errors.py). The middleware (middleware.py) checks
the API key and the body size before any parsing, and logs every 4xx/5xx with its route.
/tokenize and /detokenize live in tokenize_routes.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

import radixlm

from ..managers.io_struct import GenerateReqInput
from ..managers.request_validation import UnsupportedFieldError, check_extra_fields
from ..metrics import MetricsCollector
from ..server_args import ServerArgs
from .chat_template import JinjaChatTemplate, resolve_chat_template
from .dashboard import add_dashboard_routes
from .errors import (
    APIError,
    error_body,
    install_error_handlers,
    json_response,
    only_item,
    start_stream,
    to_api_error,
)
from .middleware import GuardMiddleware, RequestLogMiddleware
from .openai_api import OpenAIServing
from .openai_format import DONE, SSEResponse, sse
from .openai_protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CloseSessionRequest,
    CompletionRequest,
    GenerateRequest,
    OpenSessionRequest,
)
from .server_info import health_generate, server_info, worker_load
from .tokenize_routes import add_tokenize_routes

logger = logging.getLogger(__name__)



# ---------------------------------------------------------------------- app
def create_app(tokenizer_manager: Any, server_args: ServerArgs, metrics: MetricsCollector,
               chat_template: JinjaChatTemplate | None = None) -> FastAPI:
    """Builds the FastAPI app around a running TokenizerManager."""
    template = chat_template or resolve_chat_template(server_args.chat_template, tokenizer_manager.tokenizer)
    app = FastAPI(title="radixlm", version=radixlm.__version__)
    app.state.server = ServerState(tokenizer_manager, server_args, metrics,
                                   OpenAIServing(tokenizer_manager, server_args.model_name,
                                                 server_args.model_path or "", template,
                                                 server_args.max_top_logprobs,
                                                 server_args.tool_call_parser, server_args.reasoning_parser))
    install_error_handlers(app)
    _add_native_routes(app, app.state.server)
    _add_openai_routes(app, app.state.server.openai)
    add_dashboard_routes(app, tokenizer_manager)
    add_tokenize_routes(app, tokenizer_manager)
    app.add_middleware(GuardMiddleware, api_key=server_args.api_key,
                       max_request_bytes=server_args.max_request_bytes)
    app.add_middleware(RequestLogMiddleware, log_requests=server_args.log_requests)   # outermost
    return app


@dataclasses.dataclass
class ServerState:
    tm: Any
    server_args: ServerArgs
    metrics: MetricsCollector
    openai: OpenAIServing
    started_at: float = dataclasses.field(default_factory=time.time)
    failure: str | None = None      # set when a child died: /health turns 503

    async def server_info(self) -> dict[str, Any]:
        return await server_info(self.server_args, self.tm, self.started_at)


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
    @app.get("/model_info")             # the name SGLang's gateway asks for first
    async def model_info() -> Response:
        info = st.tm.scheduler_info
        return json_response({"model_path": st.server_args.model_path, "tokenizer_path": st.server_args.tokenizer_path,
                      "is_generation": bool(info.get("is_generation", True)),
                      "served_model_name": st.server_args.model_name, "max_model_len": st.tm.context_len})

    @app.get("/get_load")                # SGLang's gateway: load per DP replica (server_info.py)
    async def get_load() -> Response:
        return json_response(worker_load(st.tm, st.server_args.dp_size))

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Response:
        return json_response(await st.server_info())

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        running = st.tm.num_running_requests()
        if running:
            raise APIError(400, f"Cannot flush the cache while {running} request(s) are running")
        out = await st.tm.flush_cache()
        if not out.success:
            raise APIError(400, out.message or "Cache flush refused")
        return json_response({"success": True, "message": out.message or "Cache flushed."})

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> Response:
        if not body.rid and not body.abort_all:
            raise APIError(400, "abort_request needs 'rid' (or 'abort_all': true)", param="rid")
        st.tm.abort_request("" if body.abort_all else body.rid)
        return json_response({"success": True})

    @app.post("/open_session")           # SGLang's: answers the new session's id as a JSON string
    async def open_session(body: OpenSessionRequest) -> Response:
        try:
            return json_response(st.tm.open_session(body.capacity_of_str_len, body.session_id))
        except ValueError as e:
            raise APIError(400, str(e), param="session_id") from None

    @app.post("/close_session")
    async def close_session(body: CloseSessionRequest) -> Response:
        try:
            st.tm.close_session(body.session_id)
        except ValueError as e:
            raise APIError(400, str(e), param="session_id") from None
        return Response(status_code=200)

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
    obj = GenerateReqInput(**body.model_dump(exclude=set(extra)))
    if not body.stream:
        return json_response(await only_item(st.tm.generate(obj, request)))
    stream = await start_stream(st.tm.generate(obj, request))

    async def events() -> Any:
        try:
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
        return json_response(serving.list_models())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        return json_response(serving.retrieve_model(model_id))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat_completions(body, request)
