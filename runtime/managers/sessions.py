"""Sessions (SGLang's `/open_session`, `/close_session`, `session_params` on `/generate`): the
conversation side, kept by the TokenizerManager.

A session is a tree of its requests by rid. A request with `session_params = {id, rid, offset,
replace, drop_previous_output}` continues the conversation at request `rid` without re-sending it:
its input is that request's prompt + output (prompt only with `drop_previous_output`), cut to the
first `offset` tokens when `offset` is given (negative counts from the end: a rollback), followed
by its own tokens (a leading BOS dropped). `rid` null starts a new root. With `replace`, the
request replaces the children of `rid` (they and their descendants leave the session and any that
is running is aborted); `replace` with `rid` null clears the session.

The KV side lives in the scheduler (mem_cache/session_locks.py): every finished request of an open
session keeps its sequence locked in the radix tree, so the next turn is a prefix hit, until the
session is closed or its locked tokens exceed `capacity_of_str_len` (then the oldest are unlocked
and fall back to ordinary LRU).

Every problem is a ValueError (a 400) with the reason; nothing is sent for a refused request.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .io_struct import AbortReq, CloseSessionReq, OpenSessionReq

MAX_SESSIONS = 10_000
SESSION_PARAM_FIELDS = {"id", "rid", "offset", "replace", "drop_previous_output"}


@dataclass
class SessionReq:
    rid: str
    input_ids: list[int]
    parent: str | None
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    children: list[str] = field(default_factory=list)


@dataclass
class Session:
    session_id: str
    capacity: int
    reqs: dict[str, SessionReq] = field(default_factory=dict)
    dp_rank: int | None = None      # dp_size > 1: the replica that holds its KV (its first turn's)

    def drop_subtree(self, rid: str) -> list[str]:
        """Removes `rid` and its descendants; returns their rids."""
        out, stack = [], [rid]
        while stack:
            node = self.reqs.pop(stack.pop(), None)
            if node is not None:
                out.append(node.rid)
                stack.extend(node.children)
        return out


class SessionStore:
    """The open sessions of one TokenizerManager; `send_all` reaches every scheduler replica."""

    def __init__(self, bos_token_id: int | None, send_all: Callable[[Any], None] | None = None) -> None:
        self.bos_token_id = bos_token_id
        self.send_all = send_all or (lambda msg: None)
        self.sessions: dict[str, Session] = {}
        self._session_of_rid: dict[str, str] = {}      # running session requests

    def open(self, capacity: Any, session_id: Any = None) -> Session:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError("capacity_of_str_len must be a non-negative integer")
        if session_id is not None and (not isinstance(session_id, str) or not session_id or len(session_id) > 256):
            raise ValueError("session_id must be a non-empty string of at most 256 characters")
        if session_id in self.sessions:
            raise ValueError("A session with this session_id is already open")
        if len(self.sessions) >= MAX_SESSIONS:
            raise ValueError(f"Too many open sessions (at most {MAX_SESSIONS}); close some first")
        session = Session(session_id or uuid.uuid4().hex, capacity)
        self.sessions[session.session_id] = session
        return session

    def open_and_announce(self, capacity: Any, session_id: Any = None) -> str:
        session = self.open(capacity, session_id)
        self.send_all(OpenSessionReq(session.session_id, session.capacity))
        return session.session_id

    def close_and_announce(self, session_id: Any) -> None:
        self.close(session_id)
        self.send_all(CloseSessionReq(session_id))

    def commit_and_announce(self, params: dict, rid: str, input_ids: list[int]) -> None:
        """`commit`, then the branches `replace` dropped are aborted if still running and their KV
        locks released."""
        dropped = self.commit(params, rid, input_ids)
        for old in dropped:
            if self.is_running(old):
                self.send_all(AbortReq(old, "replaced in its session"))
        if dropped:
            self.send_all(CloseSessionReq(params["id"], dropped))

    def close(self, session_id: Any) -> Session:
        session = self.sessions.pop(session_id, None) if isinstance(session_id, str) else None
        if session is None:
            raise ValueError("Unknown session id: no open session has it")
        return session

    def get(self, session_id: Any) -> Session:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise ValueError("Invalid session_params: unknown session id (open one with /open_session)")
        return session

    def resolve(self, params: Any, ids: list[int]) -> list[int]:
        """The full input of a session request whose own tokens are `ids`. Changes nothing; raises
        ValueError for bad params (unknown session or rid, an unfinished rid, a bad offset)."""
        if not isinstance(params, dict):
            raise ValueError("session_params must be an object {id, rid, offset, replace}")
        unknown = sorted(set(params) - SESSION_PARAM_FIELDS)
        if unknown:
            raise ValueError(f"session_params: unknown field(s) {unknown}")
        session = self.get(params.get("id"))
        parent_rid, offset = params.get("rid"), params.get("offset")
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
            raise ValueError("session_params: offset must be an integer")
        if parent_rid is None:
            return list(ids)
        parent = session.reqs.get(parent_rid) if isinstance(parent_rid, str) else None
        if parent is None:
            raise ValueError("session_params: rid names no request of this session")
        if not parent.finished:
            raise ValueError("session_params: rid names a request that has not finished yet")
        base = parent.input_ids + ([] if params.get("drop_previous_output") else parent.output_ids)
        if offset:
            if not -len(base) <= offset <= len(base):
                raise ValueError(f"session_params: offset must be in [-{len(base)}, {len(base)}] "
                                 "(the tokens of the request it continues)")
            base = base[:offset]
        own = list(ids)
        if own and self.bos_token_id is not None and own[0] == self.bos_token_id:
            own = own[1:]
        return base + own

    def commit(self, params: dict, rid: str, input_ids: list[int]) -> list[str]:
        """Registers the request (unfinished) under its parent; returns the rids that `replace`
        dropped. Raises ValueError if the session changed since `resolve` made it invalid."""
        session = self.get(params.get("id"))
        if rid in session.reqs:
            raise ValueError("session_params: this rid is already used in the session; give a new rid")
        parent_rid = params.get("rid")
        if parent_rid is not None and parent_rid not in session.reqs:
            raise ValueError("session_params: rid names no request of this session")
        dropped: list[str] = []
        if params.get("replace"):
            if parent_rid is None:
                for root in [r for r, node in session.reqs.items() if node.parent is None]:
                    dropped += session.drop_subtree(root)
            else:
                for child in session.reqs[parent_rid].children:
                    dropped += session.drop_subtree(child)
                session.reqs[parent_rid].children = []
        if parent_rid is not None:
            session.reqs[parent_rid].children.append(rid)
        session.reqs[rid] = SessionReq(rid, list(input_ids), parent_rid)
        self._session_of_rid[rid] = session.session_id
        return dropped

    def is_running(self, rid: str) -> bool:
        return rid in self._session_of_rid

    def on_finished(self, rid: str, output_ids: list[int]) -> None:
        """Records a finished session request's output (a no-op for other requests)."""
        session_id = self._session_of_rid.pop(rid, None)
        session = self.sessions.get(session_id) if session_id is not None else None
        node = session.reqs.get(rid) if session is not None else None
        if node is not None:
            node.output_ids, node.finished = list(output_ids), True
