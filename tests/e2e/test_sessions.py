"""Sessions through a real server: `/open_session`, `/close_session`, `session_params` on `/generate`.

A continuation by rid equals the same conversation sent in full (greedy), without re-sending it,
and finds its prefix in the cache even after other traffic overflowed the small pool (the session
locks it); a branch at an offset starts from that many tokens; `replace` drops the replaced
branch; closing frees every KV slot; bad ids are clear 400s that leak nothing.
"""

from __future__ import annotations

import random

import httpx
from server_fixtures import kv_state, server_fixture, wait_kv_free

server = server_fixture("--dtype", "float32", "--max-total-tokens", "1024")
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1900) for _ in range(n)]


def _gen(srv, ids: list[int], session: dict | None = None, rid: str | None = None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": GREEDY, "rid": rid}
    if session is not None:
        body["session_params"] = session
    return httpx.post(srv.url("/generate"), json=body, timeout=60)


def _open(srv, capacity: int) -> str:
    r = httpx.post(srv.url("/open_session"), json={"capacity_of_str_len": capacity}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_continue_branch_replace_and_close(server):
    rng = random.Random(0)
    first, second, third = _ids(rng, 60), _ids(rng, 20), _ids(rng, 15)
    sid = _open(server, 1000)
    a = _gen(server, first, {"id": sid}, rid="turn-a").json()
    for _ in range(4):                                   # other traffic: 4 x 300 tokens through a 1024 pool
        assert _gen(server, _ids(rng, 300)).status_code == 200

    b = _gen(server, second, {"id": sid, "rid": "turn-a"}, rid="turn-b")
    assert b.status_code == 200, b.text
    b = b.json()
    history = first + a["output_ids"]
    assert b["meta_info"]["prompt_tokens"] == len(history) + len(second)
    assert b["meta_info"]["cached_tokens"] >= len(first)            # still locked in the tree
    plain = _gen(server, history + second).json()
    assert b["output_ids"] == plain["output_ids"]                    # the same as sending it all

    c = _gen(server, third, {"id": sid, "rid": "turn-a", "offset": 25}, rid="turn-c").json()
    assert c["meta_info"]["prompt_tokens"] == 25 + len(third)
    assert c["output_ids"] == _gen(server, first[:25] + third).json()["output_ids"]

    d = _gen(server, third, {"id": sid, "rid": "turn-a", "replace": True}, rid="turn-d")
    assert d.status_code == 200, d.text
    gone = _gen(server, second, {"id": sid, "rid": "turn-b"})        # turn-b was replaced
    assert gone.status_code == 400 and "rid" in gone.json()["error"]["message"]

    state = kv_state(server)
    assert state["session_locked_tokens"] > 0 and not state["kv_fully_free"]
    assert httpx.post(server.url("/close_session"), json={"session_id": sid}, timeout=10).status_code == 200
    state = wait_kv_free(server)
    assert state["session_locked_tokens"] == 0 and state["kv_protected_tokens"] == 0


def test_capacity_exceeded_falls_back_to_lru(server):
    sid = _open(server, 10)
    assert _gen(server, _ids(random.Random(1), 40), {"id": sid}).status_code == 200
    assert kv_state(server)["session_locked_tokens"] == 0
    assert wait_kv_free(server)["kv_fully_free"]
    httpx.post(server.url("/close_session"), json={"session_id": sid}, timeout=10)


def test_bad_session_ids_are_clear_400s(server):
    rng = random.Random(2)
    r = _gen(server, _ids(rng, 10), {"id": "no-such-session"})
    assert r.status_code == 400 and "unknown session id" in r.json()["error"]["message"]
    sid = _open(server, 100)
    r = _gen(server, _ids(rng, 10), {"id": sid, "rid": "never-sent"})
    assert r.status_code == 400 and "rid names no request" in r.json()["error"]["message"]
    r = _gen(server, _ids(rng, 10), {"id": sid, "bogus": 1})
    assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"]
    ok = _gen(server, _ids(rng, 10), {"id": sid}, rid="s-1")
    r = _gen(server, _ids(rng, 10), {"id": sid, "rid": "s-1", "offset": 999})
    assert ok.status_code == 200 and r.status_code == 400 and "offset" in r.json()["error"]["message"]
    r = httpx.post(server.url("/generate"), json={"input_ids": [[5, 6], [7, 8]], "session_params": {"id": sid}},
                   timeout=10)
    assert r.status_code == 400 and "single prompt" in r.json()["error"]["message"]
    dup = httpx.post(server.url("/open_session"), json={"capacity_of_str_len": 5, "session_id": sid}, timeout=10)
    assert dup.status_code == 400
    assert httpx.post(server.url("/close_session"), json={"session_id": sid}, timeout=10).status_code == 200
    again = httpx.post(server.url("/close_session"), json={"session_id": sid}, timeout=10)
    assert again.status_code == 400 and "Unknown session id" in again.json()["error"]["message"]
    assert wait_kv_free(server)["kv_fully_free"]


def test_locked_sessions_never_starve_the_pool(server):
    rng = random.Random(3)
    sid = _open(server, 1000)
    assert _gen(server, _ids(rng, 600), {"id": sid}).status_code == 200
    assert kv_state(server)["session_locked_tokens"] >= 600         # the session holds most of the pool
    r = _gen(server, _ids(rng, 600))                                 # needs more than is left unlocked
    assert r.status_code == 200, r.text
    assert kv_state(server)["session_locked_tokens"] == 0            # the session's lock gave way
    assert httpx.post(server.url("/close_session"), json={"session_id": sid}, timeout=10).status_code == 200
    assert wait_kv_free(server)["kv_fully_free"]
