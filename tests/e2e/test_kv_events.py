"""KV-cache events through a real server (`--kv-events-config`, ZeroMQ, vLLM's wire format).

A subscriber that joins after the server started rebuilds the cache from the events alone (the
replay socket gives it what it missed, the live stream the rest) and finds what the tree holds:
the same token count as the scheduler's tree, every recent prompt's page-aligned prefix, blocks
removed when the small pool forced evictions, and nothing after /flush_cache.
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


@pytest.fixture(scope="module")
def events_server(llama_path):
    with tempfile.TemporaryDirectory(prefix="radixlm-kv-events-") as d:
        config = {"publisher": "zmq", "endpoint": f"ipc://{d}/pub", "replay_endpoint": f"ipc://{d}/replay",
                  "topic": TOPIC}
        srv = start_server(llama_path, "--dtype", "float32", "--page-size", str(PAGE), "--max-total-tokens", "640",
                           "--kv-events-config", json.dumps(config))
        yield srv, config
        srv.stop()


def _generate(srv, ids: list[int]) -> None:
    r = httpx.post(srv.url("/generate"), json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text


def _tokens(index: BlockIndex) -> int:
    return sum(len(tokens) for _, tokens in index.blocks.values())


def test_subscriber_rebuilds_the_cache_from_events(events_server):
    srv, config = events_server
    rng = random.Random(0)
    shared = [rng.randrange(10, 1900) for _ in range(60)]
    prompts = [shared + [rng.randrange(10, 1900) for _ in range(40)] for _ in range(3)]
    prompts += [[rng.randrange(10, 1900) for _ in range(150)] for _ in range(4)]   # > 640 tokens in all
    for ids in prompts:
        _generate(srv, ids)
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

        _generate(srv, prompts[0])                                     # live events after the replay
        wait_kv_free(srv)
        tree_tokens = kv_state(srv)["radix_tree_tokens"]
        sub.drain(index, until=lambda: _tokens(index) == tree_tokens
                  and tuple(prompts[0][:len(prompts[0]) // PAGE * PAGE]) in index.prefixes())

        assert httpx.post(srv.url("/flush_cache"), timeout=30).status_code == 200
        sub.drain(index, until=lambda: not index.blocks)
        assert kv_state(srv)["radix_tree_tokens"] == 0
