"""Which request ids (rids) are taken, so that a rid is never reused while its old request lives.

A rid's life in the TokenizerManager:

    reserve(states)      the new request's rids become `active`; a rid still in use (active or
                         draining) is waited for, up to `wait_s`, then ValueError (a 400)
    release(state, ...)  the caller let go. A request that finished (its final output came back)
                         frees its rid at once. One that was aborted mid-flight moves to `draining`:
                         the scheduler and the detokenizer still hold it until the abort's final
                         output comes back through the detokenizer.
    on_output(rid, fin)  routes an output to its active state; a final output for a draining rid
                         releases that rid and wakes whoever waits for it.

A draining rid whose final output never comes (a dead child) is forgotten after `expire_s`, or at
once by `clear()`. Not thread-safe: call from the manager's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

RID_RELEASE_WAIT_S = 5.0       # how long a new request waits for a draining rid
DRAIN_EXPIRE_S = 600.0


class RidRegistry:
    def __init__(self, wait_s: float = RID_RELEASE_WAIT_S, expire_s: float = DRAIN_EXPIRE_S):
        self.active: dict[str, Any] = {}                    # rid -> ReqState
        self.draining: dict[str, float] = {}                # rid -> when the abort was sent
        self._waiters: dict[str, asyncio.Future] = {}       # rid -> released (only while someone waits)
        self.wait_s = wait_s
        self.expire_s = expire_s

    def in_use(self, rid: str) -> bool:
        return rid in self.active or rid in self.draining

    async def reserve(self, states: list[Any]) -> None:
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

    def release(self, state: Any, draining: bool) -> None:
        """Forgets `state`; with `draining`, its rid stays taken until its final output arrives."""
        if self.active.get(state.rid) is state:
            del self.active[state.rid]
            if draining:
                self.draining[state.rid] = time.monotonic()
            else:
                self._wake(state.rid)

    def on_output(self, rid: str, finished: bool) -> Any:
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
