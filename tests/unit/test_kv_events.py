"""KV events: the wire layout a vLLM-format subscriber decodes, the block hash, the config flag,
and the publisher's replay over ZeroMQ (no model: a KVManager-free radix cache drives it)."""

from __future__ import annotations

import hashlib
import struct
import time

import msgspec
import pytest
import torch
from helpers import missing_dependency

from radixlm.runtime.mem_cache.kv_event_publisher import ZmqEventPublisher, offset_endpoint
from radixlm.runtime.mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
    KVEventsConfig,
    block_hash,
    decode_batch,
    encode_batch,
    make_batch,
)
from radixlm.runtime.mem_cache.radix_cache import RadixCache
from radixlm.runtime.server_args import ServerArgs
from radixlm.testing.kv_events import BlockIndex, KVEventSubscriber


def test_array_format_is_the_older_tagged_arrays() -> None:
    batch = make_batch([BlockStored([7, 8], None, [1, 2, 3, 4], 2, None, "CPU"), BlockRemoved([7], "CPU"),
                        AllBlocksCleared()], None)
    raw = msgspec.msgpack.decode(encode_batch(batch, "array"))               # untyped: what any msgpack reader sees
    assert isinstance(raw[0], float) and len(raw) == 3 and raw[2] is None   # [ts, events, data_parallel_rank]
    assert raw[1] == [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "CPU"],
                      ["BlockRemoved", [7], "CPU"], ["AllBlocksCleared"]]
    assert msgspec.msgpack.decode(encode_batch(make_batch([], 1), "array"))[2] == 1


def test_map_format_is_vllms_and_sglangs_current_tagged_maps() -> None:
    """The default: events as maps with a "type" key and vLLM's required `lora_name`; decode_batch
    reads both forms back to the same events."""
    events = [BlockStored([7, 8], 5, [1, 2, 3, 4], 2, None, "CPU"), BlockRemoved([7], "CPU"), AllBlocksCleared()]
    assert KVEventsConfig().event_format == "map"
    payload = encode_batch(make_batch(events, 0))
    raw = msgspec.msgpack.decode(payload)
    assert raw[1] == [{"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": 5,
                       "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "CPU",
                       "lora_name": None},
                      {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}, {"type": "AllBlocksCleared"}]
    assert raw[2] == 0
    assert decode_batch(payload).events == events == decode_batch(encode_batch(make_batch(events, 0), "array")).events
    with pytest.raises(ValueError, match="event_format"):
        KVEventsConfig.from_json('{"event_format": "json"}')


def test_sglangs_own_structs_decode_the_default_format() -> None:
    """SGLang's KV-event classes (what its consumers decode with) read what we publish."""
    try:
        from sglang.srt.disaggregation.kv_events import KVEventBatch as SGLangBatch
    except ImportError as e:
        missing_dependency(f"sglang not importable (pip install --no-deps -r tests/sglang_client.txt): {e}")
    events = [BlockStored([7, 8], 5, [1, 2, 3, 4], 2, None, "CPU"), BlockRemoved([7], "CPU"), AllBlocksCleared()]
    theirs = msgspec.msgpack.Decoder(SGLangBatch).decode(encode_batch(make_batch(events, 1)))
    stored, removed, cleared = theirs.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == ([7, 8], 5, [1, 2, 3, 4], 2)
    assert removed.block_hashes == [7] and type(cleared).__name__ == "AllBlocksCleared"
    with pytest.raises(msgspec.ValidationError):          # the older array form is not what it reads
        msgspec.msgpack.Decoder(SGLangBatch).decode(encode_batch(make_batch(events, 1), "array"))


def test_block_hash_is_the_documented_one() -> None:
    digest = hashlib.sha256(struct.pack("<2q", 5, 6)).digest()
    root = int.from_bytes(digest[:8], "big", signed=True)
    assert block_hash(None, [5, 6]) == root
    digest = hashlib.sha256(root.to_bytes(8, "big", signed=True) + struct.pack("<2q", 7, 8)).digest()
    assert block_hash(root, [7, 8]) == int.from_bytes(digest[:8], "big", signed=True)


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"), ("[]", "JSON object"), ('{"publisher": "kafka"}', "publisher"),
    ('{"endpont": "tcp://*:1"}', "unknown field"), ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"endpoint": null}', "endpoint"), ('{"topic": 5}', "topic"),
])
def test_bad_config_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(kv_events_config=text).validate()


def test_config_defaults_and_dp_offsets() -> None:
    config = KVEventsConfig.from_json('{"publisher": "zmq"}')
    assert config.enabled and config.endpoint == "tcp://*:5557" and config.replay_endpoint is None
    assert not KVEventsConfig.from_json('{"publisher": "zmq", "enable_kv_cache_events": false}').enabled
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/x", 1) == "ipc:///tmp/x_dp1"


def test_publisher_replays_to_a_late_subscriber_then_streams(tmp_path) -> None:
    config = KVEventsConfig(publisher="zmq", endpoint=f"ipc://{tmp_path}/pub",
                            replay_endpoint=f"ipc://{tmp_path}/replay", topic="t")
    recorder = KVEventRecorder(2, "CPU")
    cache = RadixCache(2, events=recorder)
    publisher = ZmqEventPublisher(config)
    try:
        cache.insert([1, 2, 3, 4], torch.arange(1, 5))
        publisher.publish(recorder.take())
        cache.insert([1, 2, 5, 6], torch.arange(5, 9))
        cache.evict(2)                                                 # the LRU leaf [3, 4]
        publisher.publish(recorder.take())
        time.sleep(0.2)                                                # published before anyone listens
        index = BlockIndex()
        with KVEventSubscriber(config.endpoint, config.replay_endpoint, "t") as sub:
            assert sub.replay(index) == 2 and index.last_seq == 1
            assert index.prefixes() == {(1, 2), (1, 2, 5, 6)} and index.removed == 1
            cache.reset()
            publisher.publish(recorder.take())
            sub.drain(index, until=lambda: index.last_seq == 2)
            assert not index.blocks
    finally:
        publisher.shutdown()
