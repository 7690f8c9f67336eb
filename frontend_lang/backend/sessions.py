"""Server sessions for DSL programs: a multi-turn program, or one that forks, keeps its conversation's
KV locked in the server's radix tree (SGLang's `/open_session` and `session_params`), and each turn
sends only the text added since the previous request.

One `ProgramSession` per program (its forks share it), one `SessionCursor` per program state:

    opened      lazily, at the program's second request or its first fork, so a one-gen program
                costs no extra round trip; closed when the program (and every fork) has ended
    request 1   in the session: the whole text, `session_params {"id"}` (a new root)
    request k   the text after request k-1's *prompt*, `session_params {"id", "rid": request k-1,
                "drop_previous_output": true}`: the server's input is request k-1's prompt tokens
                followed by this text's tokens (the previous output is re-sent as text, so stop
                trimming and skipped special tokens never make the server's history differ from
                the program's text; when its tokens are the ones the model produced, the KV of the
                output is a prefix hit too)
    fork        the prefix is one prefill-only request in the session; every branch continues from
                it, so the branches share its locked KV

A server without sessions (404 on /open_session), or one that refuses a session request (a gateway
that sent the turn to another worker), turns sessions off for the program, which then sends whole
texts as before. `RuntimeEndpoint(..., use_sessions=False)` never opens one.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class SessionServer(Protocol):
    def open_session(self, capacity: int) -> str | None: ...
    def close_session(self, session_id: str) -> None: ...


@dataclass
class ProgramSession:
    """The server session of one program; thread-safe (forks run in their own threads)."""

    server: SessionServer
    capacity: int
    session_id: str | None = None
    disabled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ensure_open(self) -> str | None:
        with self.lock:
            if self.session_id is None and not self.disabled:
                self.session_id = self.server.open_session(self.capacity)
                self.disabled = self.session_id is None
            return None if self.disabled else self.session_id

    def disable(self, reason: str) -> None:
        with self.lock:
            if not self.disabled:
                logger.warning("DSL program continues without its server session: %s", reason)
            self.disabled = True

    def close(self) -> None:
        with self.lock:
            session_id, self.session_id, self.disabled = self.session_id, None, True
        if session_id is not None:
            self.server.close_session(session_id)


class SessionCursor:
    """Where one program state is in its session: the request it continues and that request's
    prompt length in characters of the program's text."""

    def __init__(self, session: ProgramSession) -> None:
        self.session = session
        self.rid: str | None = None
        self.prompt_end = 0
        self.requests = 0

    def branch(self) -> SessionCursor:
        child = SessionCursor(self.session)
        child.rid, child.prompt_end, child.requests = self.rid, self.prompt_end, self.requests
        return child

    def prepare(self, body: dict[str, Any], text: str, force_open: bool = False
                ) -> tuple[dict[str, Any], str | None]:
        """(`body`, a /generate body for `text`, put in the session; its rid), or (`body`, None)
        when it goes outside any session (sessions off, or the program's first request)."""
        self.requests += 1
        if self.session.session_id is None and self.requests < 2 and not force_open:
            return body, None
        session_id = self.session.ensure_open()       # None: sessions are off for this program
        if session_id is None:
            return body, None
        rid = uuid.uuid4().hex
        params: dict[str, Any] = {"id": session_id}
        if self.rid is not None:      # the program's text only grows: it starts with that prompt
            params.update(rid=self.rid, drop_previous_output=True)
            body["text"] = text[self.prompt_end:]
        body["rid"], body["session_params"] = rid, params
        return body, rid

    def advance(self, rid: str, prompt_len: int) -> None:
        """Request `rid` (whose prompt was the program's first `prompt_len` characters) finished."""
        self.rid, self.prompt_end = rid, prompt_len
