"""The offline `radixlm.Engine`: the runtime without HTTP, mirroring `sglang.Engine`.

    Engine(model_path=..., **server_args)
      launch_subprocesses   scheduler(s) + detokenizer, readiness handshake, watchdog
      EngineCore            a private asyncio loop in a daemon thread, running the TokenizerManager
      generate / async_generate / open_session / close_session / flush_cache / get_server_info /
      abort_request / shutdown

Sync methods block the calling thread on a future of the private loop; async methods await it
from the caller's own loop. When a child process dies, every pending call raises RuntimeError and
the engine shuts itself down. Resources are released by `shutdown()`, the context manager, garbage
collection or interpreter exit (weakref.finalize), whichever comes first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from ..managers.io_struct import FlushCacheOut, GenerateReqInput
from ..managers.tokenizer_manager import TokenizerManager
from ..server_args import ServerArgs
from .launch import Subprocesses, launch_subprocesses
from .server_info import server_info

logger = logging.getLogger(__name__)

_DONE = object()      # end of an async iterator, as a value (StopAsyncIteration cannot cross futures)
WAIT_SLICE_S = 0.5    # how often a blocked sync call re-checks that the loop is still alive


async def _next_item(agen: AsyncIterator) -> Any:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _DONE


def _request(call_args: dict[str, Any]) -> GenerateReqInput:
    """The request of one `generate` / `async_generate` call, from its arguments (`locals()`):
    every parameter is a GenerateReqInput field of the same name, except `prompt` (`text`)."""
    fields = {k: v for k, v in call_args.items() if k != "self"}
    return GenerateReqInput(text=fields.pop("prompt"), **fields)


async def _in_loop(fn: Any, *args: Any) -> Any:
    """Runs a plain TokenizerManager method on the engine's loop (its state is owned there)."""
    return fn(*args)


async def _only_item(agen: Any) -> Any:
    try:
        return await agen.__anext__()
    finally:
        await agen.aclose()


class EngineCore:
    """Owns the loop thread, the child processes and the TokenizerManager (no reference to the
    Engine, so the Engine can be garbage-collected)."""

    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.dead_message: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="radixlm-engine-loop", daemon=True)
        self.thread.start()
        self.subprocs: Subprocesses | None = None
        self.tm: TokenizerManager | None = None

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        try:
            self.subprocs = launch_subprocesses(self.server_args, on_child_death=self.on_child_death)
            self.tm = self.call(self._make_tokenizer_manager())
        except BaseException:
            self.shutdown()
            raise

    async def _make_tokenizer_manager(self) -> TokenizerManager:
        tm = TokenizerManager(self.server_args, self.subprocs.port_args, self.subprocs.scheduler_info)
        tm.start()
        return tm

    # ------------------------------------------------------- crossing threads
    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        if self.closed:
            coro.close()
            raise RuntimeError(self.dead_message or "The engine has been shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine) -> Any:
        """Runs `coro` on the engine loop and blocks for its result."""
        fut = self.submit(coro)
        while True:
            try:
                return fut.result(timeout=WAIT_SLICE_S)
            except concurrent.futures.TimeoutError:
                if not self.thread.is_alive():
                    raise RuntimeError(self.dead_message or "The engine has been shut down") from None
            except concurrent.futures.CancelledError:
                raise RuntimeError(self.dead_message or "The engine has been shut down") from None

    async def acall(self, coro: Coroutine) -> Any:
        """Awaits `coro` (run on the engine loop) from another event loop."""
        fut = self.submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if fut.cancelled() and self.dead_message is not None:
                raise RuntimeError(self.dead_message) from None
            raise

    def iterate(self, agen: AsyncIterator) -> Iterator[Any]:
        try:
            while (item := self.call(_next_item(agen))) is not _DONE:
                yield item
        finally:
            self._close_quietly(agen)

    async def aiterate(self, agen: AsyncIterator) -> AsyncIterator[Any]:
        try:
            while (item := await self.acall(_next_item(agen))) is not _DONE:
                yield item
        finally:
            self._close_quietly(agen)

    def _close_quietly(self, agen: Any) -> None:
        """Closes a TokenizerManager generator on its loop (aborting an unfinished request)."""
        if not self.closed:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self.loop)

    # ---------------------------------------------------------- failure, end
    def on_child_death(self, name: str, exitcode: int | None) -> None:
        """Watchdog thread: fail everything pending, then shut down."""
        self.dead_message = (f"radixlm {name} process died unexpectedly (exit code {exitcode}); "
                             "the engine has shut down")
        logger.error(self.dead_message)
        if self.tm is not None:
            self.tm.fail_all(self.dead_message)
        self.shutdown()

    def shutdown(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if self.subprocs is not None:
            self.subprocs.shutdown()
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_loop(), self.loop)
            if threading.current_thread() is self.thread:   # e.g. a finalizer run by GC on the loop
                return
            self.thread.join(timeout=5.0)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()

    async def _stop_loop(self) -> None:
        """Lets failed requests raise, cancels what is left, closes sockets, stops the loop."""
        await asyncio.sleep(0.05)
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.tm is not None:
            self.tm.close()
            self.tm.ctx.destroy(linger=0)
        self.loop.call_soon(self.loop.stop)


class Engine:
    """In-process LLM engine: `Engine(model_path=..., **server_args)` (see ServerArgs for names)."""

    def __init__(self, model_path: str | None = None, **server_args_kwargs: Any):
        server_args_kwargs.setdefault("log_level", "error")
        args = ServerArgs.from_kwargs(model_path=model_path, **server_args_kwargs).resolved()
        args.validate()
        if args.node_rank != 0:
            raise ValueError("An Engine is node 0 of a multi-node TP group; start the other nodes with "
                             "`python -m radixlm.launch_server ... --node-rank N`")
        self.server_args = args
        self._core = EngineCore(args)
        self._finalizer = weakref.finalize(self, self._core.shutdown)
        self._core.start()

    # --------------------------------------------------------------- views
    @property
    def tokenizer_manager(self) -> TokenizerManager:
        if self._core.tm is None:
            raise RuntimeError(self._core.dead_message or "The engine is not running")
        return self._core.tm

    @property
    def tokenizer(self) -> Any:
        return self.tokenizer_manager.tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def scheduler_info(self) -> dict[str, Any]:
        return self.tokenizer_manager.scheduler_info

    @property
    def subprocesses(self) -> Subprocesses | None:
        return self._core.subprocs

    # ------------------------------------------------------------ generate
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None, return_text_in_logprobs: bool = False,
                 stream: bool = False, rid: str | list[str] | None = None,
                 session_params: dict | None = None) -> Any:
        """Single prompt -> dict; batch (a list), or n > 1 -> list of dicts. With `stream=True`
        returns an iterator of cumulative chunks (a batch's chunks carry "index").
        `session_params` ({id, rid, offset, replace, drop_previous_output}) continues a session
        opened with `open_session`, as on the server's /generate."""
        agen = self.tokenizer_manager.generate(_request(locals()))
        if stream:
            return self._core.iterate(agen)
        return self._core.call(_only_item(agen))

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None,
                             return_logprob: bool | list[bool] = False,
                             logprob_start_len: int | list[int] | None = None,
                             top_logprobs_num: int | list[int] | None = None,
                             return_text_in_logprobs: bool = False, stream: bool = False,
                             rid: str | list[str] | None = None, session_params: dict | None = None) -> Any:
        """Like `generate`, awaited from any event loop; with `stream=True` it returns an async
        iterator (`async for chunk in await engine.async_generate(..., stream=True)`)."""
        agen = self.tokenizer_manager.generate(_request(locals()))
        if stream:
            return self._core.aiterate(agen)
        return await self._core.acall(_only_item(agen))

    # ------------------------------------------------------------- control
    def abort_request(self, rid: str) -> None:
        """Aborts a request (or an n > 1 group) by rid; "" aborts everything."""
        if not self._core.closed:
            self._core.loop.call_soon_threadsafe(self.tokenizer_manager.abort_request, rid)

    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """Opens a session (the server's /open_session) and returns its id; ValueError if refused."""
        return self._core.call(_in_loop(self.tokenizer_manager.open_session, capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> None:
        """Closes a session: its KV falls back to ordinary LRU (ValueError for an unknown id)."""
        self._core.call(_in_loop(self.tokenizer_manager.close_session, session_id))

    def flush_cache(self) -> FlushCacheOut:
        """Empties the prefix cache; refused (success False) while requests run."""
        return self._core.call(self.tokenizer_manager.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        """The same report as the server's /get_server_info (the API key redacted)."""
        return self._core.call(server_info(self.server_args, self.tokenizer_manager))

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def is_running(self) -> bool:
        return not self._core.closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
