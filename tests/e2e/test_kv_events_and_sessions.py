"""KV-cache events and sessions through one real server (page size 4, a 1024-token pool, events on).

KV events (`--kv-events-config`, ZeroMQ, vLLM's wire format): a subscriber that joins after the
server started rebuilds the cache from the events alone (the replay socket gives it what it
missed, the live stream the rest) and finds what the tree holds: the same token count as the
scheduler's tree, every recent prompt's page-aligned prefix, blocks removed when the small pool
forced evictions, and nothing after /flush_cache.

Sessions (`/open_session`, `/close_session`, `session_params` on `/generate`): a continuation by
rid equals the same conversation sent in full (greedy), without re-sending it, and finds its
prefix in the cache even after other traffic overflowed the pool (the session locks it); a branch
at an offset starts from that many tokens; `replace` drops the replaced branch; closing frees
every KV slot; locks give way rather than starve the pool; bad ids are clear 400s that leak nothing.
"""

from __future__ import annotations

import json
import random
import tempfile

import httpx
import pytest
from server_fixtures import kv_state, start_server, wait_kv_free

from radixlm.testing.kv_events import BlockIndex, KVEventSubscriber

PAGE = 4
TOPIC = "kv-events"
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def events_server(llama_path):
    with tempfile.TemporaryDirectory(prefix="radixlm-kv-events-") as d:
        config = {"publisher": "zmq", "endpoint": f"ipc://{d}/pub", "replay_endpoint": f"ipc://{d}/replay",
                  "topic": TOPIC}
        srv = start_server(llama_path, "--dtype", "float32", "--page-size", str(PAGE), "--max-total-tokens", "1024",
                           "--kv-events-config", json.dumps(config))
        yield srv, config
        srv.stop()


@pytest.fixture(scope="module")
def server(events_server):
    return events_server[0]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1900) for _ in range(n)]


def _gen(srv, ids: list[int], session: dict | None = None, rid: str | None = None) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": GREEDY, "rid": rid}
    if session is not None:
        body["session_params"] = session
    return httpx.post(srv.url("/generate"), json=body, timeout=60)


def _tokens(index: BlockIndex) -> int:
    return sum(len(tokens) for _, tokens in index.blocks.values())


# ------------------------------------------------------------------------------ sessions
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


# ------------------------------------------------------------------------------ KV events
def test_subscriber_rebuilds_the_cache_from_events(events_server):
    srv, config = events_server
    rng = random.Random(0)
    shared = [rng.randrange(10, 1900) for _ in range(60)]
    prompts = [shared + [rng.randrange(10, 1900) for _ in range(40)] for _ in range(3)]
    prompts += [[rng.randrange(10, 1900) for _ in range(250)] for _ in range(4)]   # > 1024 tokens in all
    for ids in prompts:
        assert _gen(srv, ids).status_code == 200
    wait_kv_free(srv)
    tree_tokens = kv_state(srv)["radix_tree_tokens"]

    index = BlockIndex()
    with KVEventSubscriber(config["endpoint"], config["replay_endpoint"], TOPIC) as sub:
        assert sub.replay(index) > 0                                   # joined late: the replay has it all
        sub.drain(index, until=lambda: _tokens(index) == tree_tokens)
        assert index.stored > 0 and index.removed > 0, (index.stored, index.removed)   # evictions happened
        prefixes = index.prefixes()
        for ids in prompts[-2:]:                                       # the newest are still cached
            aligned = len(ids) // PAGE * PAGE
            assert tuple(ids[:aligned]) in prefixes
        assert tuple(prompts[0][:len(prompts[0]) // PAGE * PAGE]) not in prefixes   # the oldest went

        assert _gen(srv, prompts[0]).status_code == 200                                     # live events after the replay
        wait_kv_free(srv)
        tree_tokens = kv_state(srv)["radix_tree_tokens"]
        sub.drain(index, until=lambda: _tokens(index) == tree_tokens
                  and tuple(prompts[0][:len(prompts[0]) // PAGE * PAGE]) in index.prefixes())

        assert httpx.post(srv.url("/flush_cache"), timeout=30).status_code == 200
        sub.drain(index, until=lambda: not index.blocks)
        assert kv_state(srv)["radix_tree_tokens"] == 0
