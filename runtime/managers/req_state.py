"""What the TokenizerManager knows about its in-flight requests: one ReqState per sub-request, the
RidRegistry of the rids taken, the output budget, token display texts and the idle memory trim.

Output grows as BatchStrOut items arrive. Two bounds keep one request's memory in the HTTP process
finite (sizes are estimates: text characters + ESTIMATED_ENTRY_BYTES per logprob entry + 8 bytes per
token id, close to the JSON size):

    out_bytes     everything accumulated so far          > --max-response-bytes: abort
    unsent_bytes  output not yet taken by a streaming     > --max-stream-buffer-bytes: abort
                  consumer (the client is not reading)     (input logprobs are not counted: they
                                                            come once, bounded by the prompt)

A rid's life in the RidRegistry (so that a rid is never reused while its old request lives):

    reserve(states)      the new request's rids become `active`; a rid still in use (active or
                         draining) is waited for, up to `wait_s`, then ValueError (a 400)
    release(state, ...)  the caller let go. A request that finished (its final output came back)
                         frees its rid at once. One that was aborted mid-flight moves to `draining`:
                         the scheduler and the detokenizer still hold it until the abort's final
                         output comes back through the detokenizer.
    on_output(rid, fin)  routes an output to its active state; a final output for a draining rid
                         releases that rid and wakes whoever waits for it.

A draining rid whose final output never comes (a dead child) is forgotten after `expire_s`, or at
once by `clear_draining()`. Nothing here is thread-safe: call it from the manager's event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ESTIMATED_ENTRY_BYTES = 40      # one [logprob, token_id, text] triple in JSON
TRIM_AFTER_BYTES = 16 * 1024 * 1024
TRIM_DELAY_S = 1.0
RID_RELEASE_WAIT_S = 5.0       # how long a new request waits for a draining rid
DRAIN_EXPIRE_S = 600.0


@dataclass
class ReqState:
    """Output lists are cumulative."""

    rid: str
    index: int                              # position in the caller's result list
    notify: asyncio.Queue                   # shared by the sub-requests of one generate call
    return_logprob: bool
    text_in_logprobs: bool
    prompt_tokens: int
    stream: bool = False
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    jump_forward_tokens: int = 0
    forward_passes: int = 0
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    logprobs: dict[str, list] = field(default_factory=lambda: {
        "input_token_logprobs": [], "input_top_logprobs": [], "output_token_logprobs": [],
        "output_top_logprobs": []})
    last_token_time: float | None = None
    yielded_len: int = -1                   # len(output_ids) at the last streamed chunk
    error: str | None = None
    reported: bool = False                  # on_request_finished was called
    out_bytes: int = 0                      # estimated size of the output so far
    unsent_bytes: int = 0                   # estimated output since the last streamed chunk
    limit_abort: str | None = None          # why the manager aborted it (a budget was exceeded)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, index: int | None, speculative: bool) -> dict[str, Any]:
        """The SGLang-shaped result so far: text, output_ids, meta_info (and `index` in a batch)."""
        meta: dict[str, Any] = {
            "id": self.rid, "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "e2e_latency": time.perf_counter() - self.created, "jump_forward_tokens": self.jump_forward_tokens,
            "forward_passes": self.forward_passes}
        if speculative:                  # SGLang's names; accept length = tokens per verify pass
            meta["spec_verify_ct"] = self.spec_verify_ct
            meta["spec_accept_length"] = ((self.spec_accepted_tokens + self.spec_verify_ct) / self.spec_verify_ct
                                          if self.spec_verify_ct else 0.0)
        if self.return_logprob:
            meta.update({k: list(v) for k, v in self.logprobs.items()})
        out = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out


def _entries(pairs: list | None, nested: bool = False) -> int:
    if not pairs:
        return 0
    if nested:
        return sum(len(top) for top in pairs if top)
    return len(pairs)


def charge_output(st: ReqState, tok: Any, text_delta: str) -> None:
    """Adds one output item's estimated size to the state's budget counters."""
    out = len(text_delta) + 8 * len(tok.new_token_ids)
    if st.return_logprob:
        out += ESTIMATED_ENTRY_BYTES * (_entries(tok.output_token_logprobs)
                                        + _entries(tok.output_top_logprobs, nested=True))
        inp = _entries(tok.input_token_logprobs) + _entries(tok.input_top_logprobs, nested=True)
        st.out_bytes += ESTIMATED_ENTRY_BYTES * inp
    st.out_bytes += out
    st.unsent_bytes += out


def over_budget(st: ReqState, max_response_bytes: int, max_stream_buffer_bytes: int) -> str | None:
    """The abort message when a budget is exceeded, else None."""
    if st.out_bytes > max_response_bytes:
        return f"the response grew past --max-response-bytes ({max_response_bytes} bytes)"
    if st.stream and st.unsent_bytes > max_stream_buffer_bytes:
        return (f"the client did not read the stream: more than --max-stream-buffer-bytes "
                f"({max_stream_buffer_bytes} bytes) waited unread")
    return None


class RidRegistry:
    def __init__(self, wait_s: float = RID_RELEASE_WAIT_S, expire_s: float = DRAIN_EXPIRE_S):
        self.active: dict[str, ReqState] = {}
        self.draining: dict[str, float] = {}                # rid -> when the abort was sent
        self._waiters: dict[str, asyncio.Future] = {}       # rid -> released (only while someone waits)
        self.wait_s = wait_s
        self.expire_s = expire_s

    def in_use(self, rid: str) -> bool:
        return rid in self.active or rid in self.draining

    async def reserve(self, states: list[ReqState]) -> None:
        """Makes every state's rid active, or raises ValueError and reserves none of them. A rid
        still in use (active or draining) is waited for, up to `wait_s` in all."""
        self._expire()
        rids = [st.rid for st in states]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        busy = [rid for rid in rids if self.in_use(rid)]
        while busy:
            rid = busy[0]
            try:
                await asyncio.wait_for(asyncio.shield(self._waiter(rid)), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                state = "is still being aborted" if rid in self.draining else "is used by a request in flight"
                raise ValueError(f"Request id {rid!r} {state}; wait for it to finish or use a new rid") from None
            busy = [rid for rid in rids if self.in_use(rid)]
        for st in states:
            self.active[st.rid] = st

    def _waiter(self, rid: str) -> asyncio.Future:
        fut = self._waiters.get(rid)
        if fut is None:
            fut = self._waiters[rid] = asyncio.get_running_loop().create_future()
        return fut

    def release(self, state: ReqState, draining: bool) -> None:
        """Forgets `state`; with `draining`, its rid stays taken until its final output arrives."""
        if self.active.get(state.rid) is state:
            del self.active[state.rid]
            if draining:
                self.draining[state.rid] = time.monotonic()
            else:
                self._wake(state.rid)

    def on_output(self, rid: str, finished: bool) -> ReqState | None:
        """The active state an output belongs to (None for a draining or unknown rid)."""
        state = self.active.get(rid)
        if state is None and finished and self.draining.pop(rid, None) is not None:
            self._wake(rid)
        return state

    def _wake(self, rid: str) -> None:
        fut = self._waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.expire_s
        for rid in [r for r, t in self.draining.items() if t < cutoff]:
            logger.warning("request %s: no final output %.0f s after its abort; freeing its rid",
                           rid, self.expire_s)
            del self.draining[rid]
            self._wake(rid)

    def clear_draining(self) -> None:
        """Frees every draining rid (the runtime failed: no final output will come)."""
        for rid in list(self.draining):
            del self.draining[rid]
            self._wake(rid)


class TokenTexts:
    """Display text of token ids for logprob triples, cached per id. Reads the tokenizer only."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def warm(self, vocab_size: int) -> None:
        """Fills the cache for every token id at once (about 10 us per id). Done at startup, the
        strings sit together in memory instead of pinning heap pages between per-request objects,
        so the process's memory shrinks back after large logprob responses."""
        for tid in range(vocab_size):
            self.text(tid)

    def text(self, tid: int) -> str:
        """Non-empty display text of one token (special tokens included)."""
        text = self._cache.get(tid)
        if text is None:
            text = self.tokenizer.decode([tid], skip_special_tokens=False) or \
                str(self.tokenizer.convert_ids_to_tokens(tid)) or f"<{tid}>"
            self._cache[tid] = text
        return text

    def triples(self, entries: list | None, with_text: bool, nested: bool = False) -> list:
        """[logprob, id] pairs -> [logprob, id, text or None]; `nested`: per-position top lists."""
        if nested:
            return [None if top is None else self.triples(top, with_text) for top in entries or []]
        return [[lp, tid, self.text(tid) if with_text else None] for lp, tid in entries or []]


class MemoryTrimmer:
    """Gives the memory of large finished outputs back to the OS once the manager is idle: glibc keeps
    freed heap pages, so without this the process's RSS would stay at its peak after big responses.

    `note_released(nbytes)` after requests are forgotten; when TRIM_AFTER_BYTES have been released and
    `is_idle()` still holds TRIM_DELAY_S later, runs gc.collect() and malloc_trim(0) on the event loop
    (milliseconds; only when no request is in flight)."""

    def __init__(self, is_idle: Callable[[], bool]):
        self.is_idle = is_idle
        self.released = 0
        self._scheduled = False
        self._malloc_trim = _load_malloc_trim()

    def note_released(self, nbytes: int) -> None:
        self.released += nbytes
        if self.released >= TRIM_AFTER_BYTES and not self._scheduled and self.is_idle():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:          # a generator closed outside its loop (shutdown)
                return
            self._scheduled = True
            loop.call_later(TRIM_DELAY_S, self._trim)

    def _trim(self) -> None:
        self._scheduled = False
        if not self.is_idle():
            return
        self.released = 0
        gc.collect()
        if self._malloc_trim is not None:
            self._malloc_trim(0)


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):      # not glibc (macOS, musl): nothing to trim
        return None
