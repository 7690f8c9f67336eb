"""SessionLocks: the KV side of sessions (managers/sessions.py has the conversation side).

When a request of an open session finishes, the scheduler caches its KV as for any request and
then locks the tree path of its sequence here, so the session's next turn finds it whatever the
LRU pressure. A session holds at most `capacity` tokens so (each lock counted at its full path
length, shared prefixes included): past that, its oldest locks are dropped and those tokens fall
back to ordinary LRU. `release` (a replaced branch), `close` and `clear` (flush) unlock, and so
does `reclaim` when a waiting request cannot fit otherwise (oldest locks of any session first), so
sessions never starve the pool.

Locks go through the KVManager (`lock`/`unlock`), so the cache's evictable/protected sizes stay
exact. Not thread-safe: only the scheduler loop calls it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_manager import KVManager
    from .tree_node import TreeNode


class SessionLocks:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self.capacity: dict[str, int] = {}                                   # session id -> tokens
        self._order = itertools.count()
        # session id -> rid -> (locked node, its path length, the order the lock was taken in)
        self.locks: dict[str, OrderedDict[str, tuple[TreeNode, int, int]]] = {}

    def open(self, session_id: str, capacity: int) -> None:
        self.capacity[session_id] = capacity
        self.locks.setdefault(session_id, OrderedDict())

    def is_open(self, session_id: str | None) -> bool:
        return session_id is not None and session_id in self.capacity

    def hold(self, session_id: str, rid: str, key: list[int]) -> None:
        """Locks the cached prefix of `key` (just inserted by cache_finished_req) for the session."""
        held = self.locks[session_id]
        match = self.kv.match_prefix(key)
        length = len(match.kv_indices)
        if length == 0 or length > self.capacity[session_id]:
            return
        self.kv.lock(match.last_node)
        self._unlock(held.pop(rid, None))
        held[rid] = (match.last_node, length, next(self._order))
        while sum(entry[1] for entry in held.values()) > self.capacity[session_id]:
            self._unlock(held.popitem(last=False)[1])

    def release(self, session_id: str, rids: list[str]) -> None:
        held = self.locks.get(session_id, {})
        for rid in rids:
            self._unlock(held.pop(rid, None))

    def close(self, session_id: str) -> None:
        self.capacity.pop(session_id, None)
        for entry in self.locks.pop(session_id, {}).values():
            self._unlock(entry)

    def clear(self) -> None:
        """Drops every lock (the sessions stay open); before a cache flush."""
        for held in self.locks.values():
            for entry in held.values():
                self._unlock(entry)
            held.clear()

    def reclaim(self, needed: int) -> None:
        """Unlocks the oldest locks (in the order they were taken, across sessions) until `needed`
        slots are free or evictable, or no lock is left."""
        order = sorted(((entry[2], sid, rid) for sid, held in self.locks.items() for rid, entry in held.items()))
        for _, sid, rid in order:
            if self.kv.available_tokens() >= needed:
                return
            self._unlock(self.locks[sid].pop(rid))

    def held_tokens(self) -> int:
        return sum(entry[1] for held in self.locks.values() for entry in held.values())

    def _unlock(self, entry: tuple[TreeNode, int, int] | None) -> None:
        if entry is not None:
            self.kv.unlock(entry[0])
