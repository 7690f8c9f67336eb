"""TokenizerManager: the front of the runtime, living in the caller's asyncio loop.

One request's path through it:

    generate(obj)  RequestBuilder.build: validate + tokenize (ValueError before anything is sent);
                   one ReqState per sub-request (a batch item, or one of n samples), its rid reserved
                   in the RidRegistry (req_state.py) --TokenizedGenerateReq--> scheduler
    _recv_loop     BatchStrOut from the detokenizer: append text/ids/logprobs, wake the waiter
    generate       yields SGLang-shaped dicts: one at the end, or cumulative chunks when streaming

Sessions (sessions.py): it keeps each open session's conversation tree and tells the schedulers
to open / close a session's KV locks (OpenSessionReq / CloseSessionReq, in order with the requests).

It also sends aborts and control requests (flush cache, internal state), keeps the latest
SchedulerStats, feeds the optional metrics collector, and fails every pending request when the
watchdog reports a dead child (`fail_all`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from ..router.dp_router import DPRouter
from ..server_args import ServerArgs
from .admission_control import AdmissionControl
from .io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReqInput,
    GetInternalStateOut,
    GetInternalStateReq,
    ReqStrOut,
    SchedulerStats,
    TokenizedGenerateReq,
)
from .ipc import AsyncPuller, AsyncPusher, PortArgs
from .req_state import MemoryTrimmer, ReqState, RidRegistry, TokenTexts, charge_output, over_budget
from .request_builder import RequestBuilder
from .sessions import SessionStore

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 1.0


def load_tokenizer(server_args: ServerArgs) -> Any:
    from ..hf_tokenizer import get_tokenizer

    return get_tokenizer(server_args.tokenizer_path or server_args.model_path)


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict[str, Any],
                 metrics: Any = None):
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_info = scheduler_info
        self.metrics = metrics
        self.tokenizer = load_tokenizer(server_args)
        self.context_len: int = int(scheduler_info["context_len"])
        self.vocab_size: int = int(scheduler_info.get("vocab_size") or len(self.tokenizer))
        self.max_total_tokens: int | None = scheduler_info.get("max_total_tokens")
        self.speculative = bool(server_args.speculative_algorithm)
        self.sessions = SessionStore(getattr(self.tokenizer, "bos_token_id", None), self._send_all)
        self.builder = RequestBuilder(server_args, self.tokenizer, self.vocab_size, self.context_len,
                                      self.max_total_tokens, self.sessions)
        self.ctx = zmq.asyncio.Context()
        self.puller = AsyncPuller(self.ctx, port_args.tokenizer_input)
        self.senders = [AsyncPusher(self.ctx, port_args.scheduler_input_for(r))
                        for r in range(server_args.dp_size)]
        self.router: DPRouter | None = None              # dp_size > 1: picks the replica of a request
        self._rank_of_rid: dict[str, int] = {}
        if server_args.dp_size > 1:
            self.router = DPRouter(server_args.load_balance_method, server_args.dp_size)
        self._next_dp = 0
        self.rids = RidRegistry()                        # rids.active: rid -> ReqState of every request in flight
        self.admission = AdmissionControl(server_args.max_queued_requests, server_args.dp_size * int(
            scheduler_info.get("max_running_requests") or 1))
        self.latest_stats: SchedulerStats | None = None
        self.stats_by_dp_rank: dict[int, SchedulerStats] = {}
        self.dead_message: str | None = None
        self.token_texts = TokenTexts(self.tokenizer)
        self.token_texts.warm(len(self.tokenizer))
        self.trimmer = MemoryTrimmer(lambda: not self.rids.active)
        self._control_waiters: dict[type, deque[asyncio.Future]] = {FlushCacheOut: deque(),
                                                                     GetInternalStateOut: deque()}
        self._control_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recv_task: asyncio.Task | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the receive loop on the running event loop (idempotent; every API call does it)."""
        if self._recv_task is None:
            self._loop = asyncio.get_running_loop()
            self._control_lock = asyncio.Lock()
            self._recv_task = self._loop.create_task(self._recv_loop())

    def close(self) -> None:
        """Stops the receive loop and closes the sockets. Call from the manager's loop (or after it stopped)."""
        if self._recv_task is not None:
            self._recv_task.cancel()
        for sock in (self.puller, *self.senders):
            sock.close()
        self.builder.close()

    def num_running_requests(self) -> int:
        return len(self.rids.active)

    def _check_alive(self) -> None:
        if self.dead_message is not None:
            raise RuntimeError(self.dead_message)

    # ------------------------------------------------------------- generate
    async def generate(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[dict | list[dict]]:
        """Yields one result (dict, or list for a batch / n > 1), or cumulative chunks when
        `obj.stream` (each chunk of a batch / n > 1 carries its "index"). Raises ValueError for bad
        input (before anything is sent) and RuntimeError when the runtime failed."""
        self.start()
        self._check_alive()
        reqs, is_single, text_in_logprobs = await self.builder.build(obj)
        self.admission.check(len(self.rids.active), len(reqs))   # OverloadedError: 503
        queue: asyncio.Queue = asyncio.Queue()
        states = [ReqState(r.rid, i, queue, r.return_logprob, text_in_logprobs, len(r.input_ids),
                           stream=bool(obj.stream)) for i, r in enumerate(reqs)]
        await self.rids.reserve(states)     # ValueError (400) for a rid in use
        try:
            self._check_alive()
            if obj.session_params is not None:
                self.sessions.commit_and_announce(obj.session_params, reqs[0].rid, reqs[0].input_ids)
        except (ValueError, RuntimeError):
            for st in states:
                self.rids.release(st, draining=False)
            raise
        self._send_generate(reqs)
        watcher = asyncio.create_task(self._watch_disconnect(request, states)) if request is not None else None
        try:
            if obj.stream:
                async for chunk in self._stream_chunks(states, is_single):
                    yield chunk
            else:
                await self._wait_finished(states)
                outs = [st.output(None, self.speculative) for st in states]
                yield outs[0] if is_single else outs
        finally:
            if watcher is not None:
                watcher.cancel()
            self._release(states)

    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """Opens a session and returns its id (ValueError for a bad capacity or an id in use)."""
        self.start()
        self._check_alive()
        return self.sessions.open_and_announce(capacity_of_str_len, session_id)

    def close_session(self, session_id: str) -> None:
        """Closes a session: its KV falls back to ordinary LRU (ValueError for an unknown id)."""
        self.start()
        self.sessions.close_and_announce(session_id)

    async def _wait_finished(self, states: list[ReqState]) -> None:
        """Returns once every state finished (raises RuntimeError on a runtime failure). Looks only at
        the states named by each notification: O(1) per output, so a 10k-prompt batch does not stall
        the event loop when many outputs arrive at once."""
        queue = states[0].notify
        pending = {i for i, st in enumerate(states) if not st.finished}
        for st in states:
            if st.error is not None:
                raise RuntimeError(st.error)
        while pending:
            st = states[await queue.get()]
            if st.error is not None:
                raise RuntimeError(st.error)
            if st.finished:
                pending.discard(st.index)

    async def _stream_chunks(self, states: list[ReqState], is_single: bool) -> AsyncIterator[dict]:
        queue = states[0].notify
        pending = set(range(len(states)))
        while pending:
            updated = {await queue.get()}
            while not queue.empty():
                updated.add(queue.get_nowait())
            for i in sorted(updated):
                st = states[i]
                if st.error is not None:
                    raise RuntimeError(st.error)
                if i not in pending or (len(st.output_ids) == st.yielded_len and not st.finished):
                    continue
                st.yielded_len = len(st.output_ids)
                st.unsent_bytes = 0
                if st.finished:
                    pending.discard(i)
                yield st.output(None if is_single else i, self.speculative)

    def _release(self, states: list[ReqState]) -> None:
        """Forgets the states of a finished call; aborts any sub-request still running (the caller
        went away: client disconnect, cancelled task, closed stream, or an error)."""
        for st in states:
            running = not st.finished and st.error is None and self.dead_message is None
            if running:
                self._send_all(AbortReq(st.rid, "client went away"))
            self.rids.release(st, draining=running)   # the rid stays taken until the abort comes back
            self._report_finished(st, aborted=not st.finished or st.finish_reason.get("type") == "abort")
        self.trimmer.note_released(sum(st.out_bytes for st in states))

    async def _watch_disconnect(self, request: Any, states: list[ReqState]) -> None:
        while not all(st.finished for st in states):
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                for st in states:
                    if not st.finished:
                        logger.info("client disconnected: aborting %s", st.rid)
                        self._send_all(AbortReq(st.rid, "client disconnected"))
                return

    def _send_generate(self, reqs: list[TokenizedGenerateReq]) -> None:
        rank_of_group: dict[str, int] = {}     # n > 1 siblings go to one replica (shared prefill)
        for req in reqs:
            key = req.group_rid or req.rid
            if key not in rank_of_group:
                rank_of_group[key] = self._pick_dp_rank(req)
            elif self.router is not None:
                self.router.in_flight[rank_of_group[key]] += 1
            if self.router is not None:
                self._rank_of_rid[req.rid] = rank_of_group[key]
            if self.server_args.log_requests:
                logger.info("request %s: %d prompt tokens, %s", req.rid, len(req.input_ids), req.sampling_params)
            self.senders[rank_of_group[key]].send_nowait(req)

    def _pick_dp_rank(self, req: TokenizedGenerateReq) -> int:
        """The replica of a request: a session's turns all go where its first went (its KV is
        locked there), others as the router (or round robin) says."""
        session = self.sessions.sessions.get(req.session_id) if req.session_id else None
        if session is not None and session.dp_rank is not None:
            if self.router is not None:
                self.router.assign(session.dp_rank, req.input_ids)
            return session.dp_rank
        if self.router is not None:
            rank = self.router.pick(req.input_ids)
        else:
            rank = self._next_dp % len(self.senders)
            self._next_dp += 1
        if session is not None:
            session.dp_rank = rank
        return rank

    def _send_all(self, msg: Any) -> None:
        for sender in self.senders:
            sender.send_nowait(msg)

    # -------------------------------------------------------------- receive
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.puller.recv()
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the loop
                logger.exception("failed to handle %s", type(msg).__name__)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            now = time.perf_counter()
            for item in msg.outputs:
                st = self.rids.on_output(item.rid, item.token.finish_reason is not None)
                if st is not None:
                    self._update(st, item, now)
        elif isinstance(msg, SchedulerStats):
            self.latest_stats = msg
            self.stats_by_dp_rank[msg.dp_rank] = msg
            if self.metrics is not None:
                self.metrics.update_scheduler_stats(msg)
        elif type(msg) in self._control_waiters:
            waiters = self._control_waiters[type(msg)]
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
                    break
        else:
            logger.warning("tokenizer manager ignored a %s", type(msg).__name__)

    def _update(self, st: ReqState, item: ReqStrOut, now: float) -> None:
        tok = item.token
        st.text += item.text_delta
        st.output_ids.extend(tok.new_token_ids)
        st.prompt_tokens, st.cached_tokens = tok.prompt_tokens, tok.cached_tokens
        st.completion_tokens, st.jump_forward_tokens = tok.completion_tokens, tok.jump_forward_tokens
        st.forward_passes = tok.forward_passes
        st.spec_verify_ct, st.spec_accepted_tokens = tok.spec_verify_ct, tok.spec_accepted_tokens
        if st.return_logprob:
            lp, t, triples = st.logprobs, st.text_in_logprobs, self.token_texts.triples
            lp["input_token_logprobs"] += triples(tok.input_token_logprobs, t)
            lp["input_top_logprobs"] += triples(tok.input_top_logprobs, t, nested=True)
            lp["output_token_logprobs"] += triples(tok.output_token_logprobs, t)
            lp["output_top_logprobs"] += triples(tok.output_top_logprobs, t, nested=True)
        self._observe_latency(st, len(tok.new_token_ids), now)
        charge_output(st, tok, item.text_delta)   # --max-response-bytes, --max-stream-buffer-bytes: abort
        if st.limit_abort is None and tok.finish_reason is None:   # (the scheduler then frees its KV)
            args = self.server_args
            st.limit_abort = over_budget(st, args.max_response_bytes, args.max_stream_buffer_bytes)
            if st.limit_abort is not None:
                logger.warning("aborting %s: %s", st.rid, st.limit_abort)
                self._send_all(AbortReq(st.rid, st.limit_abort))
        if tok.finish_reason is not None:
            st.finish_reason = dict(tok.finish_reason)
            self.sessions.on_finished(st.rid, st.output_ids)
            if self.server_args.log_requests:
                logger.info("finished %s: %s, %r", st.rid, st.finish_reason, st.text)
        st.notify.put_nowait(st.index)

    def _observe_latency(self, st: ReqState, num_new: int, now: float) -> None:
        if num_new and self.metrics is not None:   # TTFT for the first token, the gap for the others
            first = st.last_token_time is None
            if first:
                self.metrics.observe_ttft(now - st.created)
            for _ in range(num_new - first):
                self.metrics.observe_itl((now - (st.last_token_time or now)) / max(num_new - first, 1))
        st.last_token_time = now if num_new else st.last_token_time

    def _report_finished(self, st: ReqState, aborted: bool) -> None:
        rank = self._rank_of_rid.pop(st.rid, None)
        if rank is not None and self.router is not None and not st.reported:
            self.router.finish(rank)
        if st.reported or self.metrics is None:
            st.reported = True
            return
        st.reported = True
        self.metrics.on_request_finished(st.prompt_tokens, st.completion_tokens,
                                         time.perf_counter() - st.created, aborted)

    # -------------------------------------------------------------- control
    def abort_request(self, rid: str) -> None:
        """Aborts one request, an n > 1 group (by its rid), or everything (rid ""). Thread-unsafe:
        call it from the manager's loop."""
        self._send_all(AbortReq(rid))

    async def flush_cache(self) -> FlushCacheOut:
        outs = await self._control(FlushCacheReq(), FlushCacheOut)
        ok = all(o.success for o in outs)
        return FlushCacheOut(ok, "; ".join(dict.fromkeys(o.message for o in outs if o.message)))

    async def get_internal_state(self) -> dict[str, Any]:
        outs = await self._control(GetInternalStateReq(), GetInternalStateOut)
        if len(outs) == 1:
            return outs[0].state
        state = {**outs[0].state, "dp_states": [o.state for o in outs]}
        if self.router is not None:
            state["dp_router"] = {"method": self.router.method, "replicas": self.router.stats()}
        return state

    async def _control(self, req: Any, reply_type: type) -> list[Any]:
        """Sends a control request to every replica and waits for one reply each (FIFO matching)."""
        self.start()
        self._check_alive()
        async with self._control_lock:
            futs = [self._loop.create_future() for _ in self.senders]
            self._control_waiters[reply_type].extend(futs)
            self._send_all(req)
            return list(await asyncio.gather(*futs))

    def fail_all(self, message: str) -> None:
        """Fails every pending request and control call with RuntimeError(message); later calls
        fail at once. Safe to call from any thread (the watchdog calls it)."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop and not loop.is_closed():
            self.dead_message = self.dead_message or message
            loop.call_soon_threadsafe(self._fail_all_now, message)
        else:
            self._fail_all_now(message)

    def _fail_all_now(self, message: str) -> None:
        self.dead_message = self.dead_message or message
        self.rids.clear_draining()
        for st in list(self.rids.active.values()):
            if not st.finished:
                st.error = message
                st.notify.put_nowait(st.index)
        for waiters in self._control_waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(RuntimeError(message))
