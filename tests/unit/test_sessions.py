"""SessionStore (the conversation side of sessions) and SessionLocks (the KV side), without a model."""

from __future__ import annotations

import pytest

from radixlm.runtime.managers.io_struct import AbortReq, CloseSessionReq, OpenSessionReq
from radixlm.runtime.managers.sessions import SessionStore
from radixlm.runtime.mem_cache.kv_manager import KVManager
from radixlm.runtime.mem_cache.session_locks import SessionLocks

BOS = 1


def _finish(store: SessionStore, sid: str, new_rid: str, ids: list[int], output: list[int], **params) -> list[int]:
    full = store.resolve({"id": sid, **params}, ids)
    store.commit({"id": sid, **params}, new_rid, full)
    store.on_finished(new_rid, output)
    return full


def test_continue_offset_rollback_and_drop_previous_output() -> None:
    sent: list = []
    store = SessionStore(BOS, sent.append)
    sid = store.open_and_announce(100)
    assert sent == [OpenSessionReq(sid, 100)]
    assert _finish(store, sid, "a", [BOS, 5, 6], [7, 8]) == [BOS, 5, 6]
    assert store.resolve({"id": sid, "rid": "a"}, [BOS, 9]) == [BOS, 5, 6, 7, 8, 9]   # BOS of the turn dropped
    assert store.resolve({"id": sid, "rid": "a", "offset": 2}, [9]) == [BOS, 5, 9]
    assert store.resolve({"id": sid, "rid": "a", "offset": -1}, [9]) == [BOS, 5, 6, 7, 9]   # rollback
    assert store.resolve({"id": sid, "rid": "a", "drop_previous_output": True}, [9]) == [BOS, 5, 6, 9]
    with pytest.raises(ValueError, match="offset"):
        store.resolve({"id": sid, "rid": "a", "offset": 6}, [9])


def test_unfinished_parent_and_reused_rid_are_refused() -> None:
    store = SessionStore(None)
    sid = store.open(10).session_id
    store.commit({"id": sid}, "a", [5])
    with pytest.raises(ValueError, match="not finished"):
        store.resolve({"id": sid, "rid": "a"}, [6])
    store.on_finished("a", [7])
    with pytest.raises(ValueError, match="already used"):
        store.commit({"id": sid}, "a", [5])


def test_replace_drops_the_branches_aborts_running_ones_and_releases_their_kv() -> None:
    sent: list = []
    store = SessionStore(None, sent.append)
    sid = store.open(10).session_id
    _finish(store, sid, "a", [5], [6])
    _finish(store, sid, "b", [7], [8], rid="a")
    store.commit({"id": sid, "rid": "b"}, "c", store.resolve({"id": sid, "rid": "b"}, [9]))   # still running
    store.commit_and_announce({"id": sid, "rid": "a", "replace": True}, "d", [5, 6, 1])
    assert sorted(store.sessions[sid].reqs) == ["a", "d"]
    assert AbortReq("c", "replaced in its session") in sent
    assert sent[-1] == CloseSessionReq(sid, ["b", "c"])
    store.commit_and_announce({"id": sid, "replace": True}, "e", [4])          # rid null: clear the session
    assert sorted(store.sessions[sid].reqs) == ["e"]


@pytest.mark.parametrize("params, message", [
    ({"id": "nope"}, "unknown session id"), ("x", "must be an object"), ({"id": "S", "rid": "zz"}, "rid names no"),
    ({"id": "S", "offset": 1.5}, "offset must be an integer"), ({"id": "S", "extra": 1}, "unknown field"),
])
def test_bad_params_are_value_errors(params, message: str) -> None:
    store = SessionStore(None)
    store.open(10, "S")
    with pytest.raises(ValueError, match=message):
        store.resolve(params, [1])


def test_open_and_close_errors() -> None:
    store = SessionStore(None)
    with pytest.raises(ValueError, match="capacity"):
        store.open(-1)
    store.open(5, "S")
    with pytest.raises(ValueError, match="already open"):
        store.open(5, "S")
    store.close("S")
    with pytest.raises(ValueError, match="Unknown session"):
        store.close("S")


def _cached(kv: KVManager, ids: list[int]) -> None:
    """Puts `ids` in the tree as a finished request would (slots from the allocator)."""
    slots = kv.allocator.alloc(len(ids))
    ins = kv.prefix_cache.insert(ids, slots)
    kv.allocator.free(slots[: ins.prefix_len])


def test_locks_hold_until_close_capacity_or_reclaim() -> None:
    kv = KVManager(64, 1, 3, 56, "cpu")
    locks = SessionLocks(kv)
    locks.open("S", capacity=10)
    _cached(kv, list(range(1, 7)))
    locks.hold("S", "a", list(range(1, 7)))
    assert kv.protected_tokens() == 6 and kv.prefix_cache.evict(100).numel() == 0   # locked: not evictable
    _cached(kv, list(range(20, 26)))
    locks.hold("S", "b", list(range(20, 26)))                 # 12 > 10: the oldest ("a") is unlocked
    assert list(locks.locks["S"]) == ["b"] and kv.protected_tokens() == 6
    locks.reclaim(kv.total_tokens)                            # the pool needs everything: "b" gives way
    assert locks.held_tokens() == 0 and kv.protected_tokens() == 0
    locks.hold("S", "b", list(range(20, 26)))
    locks.close("S")
    assert kv.protected_tokens() == 0 and not locks.is_open("S")
    assert kv.is_fully_free()
