"""Connection-level limits that uvicorn's h11 protocol lacks: read/write timeouts and a connection cap.

    protocol = limited_h11_protocol(HttpLimits.from_args(server_args))
    uvicorn.Config(app, http=protocol, ...)

One timer per connection phase (loop.call_later handles, cancelled when the phase ends):

    header phase  connection opened, or the previous response finished, until the request's headers
                  are complete. Past --http-header-timeout: 408 and close (slowloris, idle sockets).
    body phase    headers complete until the whole body arrived. Past --http-body-timeout: 408 (if no
                  response started) and close (a body shorter than its Content-Length).
    send stall    the transport's write buffer stays over its high-water mark (the client reads
                  nothing). Past --http-send-timeout: the connection is aborted and its buffered
                  output dropped; the app sees http.disconnect, so its request is aborted (KV freed).

A connection beyond --max-connections gets 503 and is closed before anything is read.
uvicorn's own keep-alive timeout still closes idle keep-alive connections first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    header_timeout: float
    body_timeout: float
    send_timeout: float
    max_connections: int

    @classmethod
    def from_args(cls, args: Any) -> HttpLimits:
        return cls(args.http_header_timeout, args.http_body_timeout, args.http_send_timeout,
                   args.max_connections)


class _Throttled:
    """Logs one line per `every_s` seconds at most (an attack must not flood the log)."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self.last = -every_s
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.suppressed += 1
            return
        more = f" (+{self.suppressed} similar)" if self.suppressed else ""
        logger.warning(msg + more, *args)
        self.last, self.suppressed = now, 0


_refused_log = _Throttled()
_timeout_log = _Throttled()


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def limited_h11_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """An H11Protocol subclass enforcing `limits` (uvicorn builds one instance per connection)."""

    class LimitedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._limit_timer: asyncio.TimerHandle | None = None
            self._timed_cycle: Any = None
            self._send_timer: asyncio.TimerHandle | None = None
            if len(self.connections) > limits.max_connections:
                _refused_log.warning("connection refused: more than --max-connections (%d) open",
                                     limits.max_connections)
                self._close_with(503, "Service Unavailable", "Too many connections")
                return
            self._arm(limits.header_timeout, "request headers", 408)

        # ---------------------------------------------------------------- phases
        def handle_events(self) -> None:
            super().handle_events()
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and cycle is not self._timed_cycle:      # new request: headers done
                self._timed_cycle = cycle
                self._disarm()
                if self.conn.their_state is h11.SEND_BODY:
                    self._arm(limits.body_timeout, "the request body", 408)
            elif self._limit_timer is not None and self._timed_cycle is cycle and \
                    self.conn.their_state is not h11.SEND_BODY and cycle is not None:
                self._disarm()                                           # body complete

        def on_response_complete(self) -> None:
            self._disarm()          # armed before super(): it may start a pipelined request at once
            self._arm(limits.header_timeout, "request headers", 408)
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_send_timer()
            super().connection_lost(exc)

        # ---------------------------------------------------------------- write stalls
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(limits.send_timeout, self._on_send_stall)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_send_timer()

        def _stop_send_timer(self) -> None:
            if getattr(self, "_send_timer", None) is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _on_send_stall(self) -> None:
            self._send_timer = None
            _timeout_log.warning("client %s read nothing for %.0f s (--http-send-timeout): dropping the "
                                 "connection", self.client, limits.send_timeout)
            self.transport.abort()

        # ---------------------------------------------------------------- timers
        def _arm(self, seconds: float, what: str, status: int) -> None:
            self._limit_timer = self.loop.call_later(seconds, self._on_timeout, seconds, what, status)

        def _disarm(self) -> None:
            if getattr(self, "_limit_timer", None) is not None:
                self._limit_timer.cancel()
                self._limit_timer = None

        def _on_timeout(self, seconds: float, what: str, status: int) -> None:
            self._limit_timer = None
            if self.transport.is_closing():
                return
            _timeout_log.warning("client %s did not send %s within %.0f s: closing", self.client, what, seconds)
            cycle = self.cycle if self.cycle is self._timed_cycle else None
            if cycle is not None and cycle.response_started:
                self.transport.close()
                return
            if cycle is not None:
                cycle.disconnected = True          # the app's own response is dropped from now on
            self._close_with(status, "Request Timeout", f"Timed out waiting for {what} ({seconds:g} s)")

        def _close_with(self, status: int, reason: str, message: str) -> None:
            self.transport.write(_raw_response(status, reason, message))
            self.transport.close()

    return LimitedH11Protocol
