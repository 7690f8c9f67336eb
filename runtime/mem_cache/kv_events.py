"""KV-cache events for KV-aware routers, in vLLM's wire format (msgpack over ZeroMQ).

What the radix cache holds is announced as *blocks*: runs of `page_size` token ids along a path of
the tree (keys are page-aligned, so a node is a whole number of blocks). The cache reports:

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
        new blocks, in path order: block i's parent is block i-1, block 0's is `parent_block_hash`
        (None at the root); `token_ids` are the blocks' tokens concatenated
    BlockRemoved(block_hashes, medium)      evicted blocks (always whole leaves of the tree)
    AllBlocksCleared()                      the cache was flushed (also sent once at startup)

A node split (a match or insert ending inside a node) changes no block, so it sends nothing.

Block hash (the subscriber can recompute it from the token ids alone): the first 8 bytes of
    sha256(parent_hash as 8-byte big-endian signed, absent at the root ++ token ids as little-endian int64)
read as a big-endian signed 64-bit integer (vLLM's `ExternalBlockHash` may be an int).

Encoding: a batch is the msgpack array `[ts, events, data_parallel_rank]` (the replica, 0 with one).
An event is, by `event_format`:
    "map" (default)    a map {"type": class name, field: value, ...}, BlockStored also carrying
                       `lora_name` (null): what current vLLM (0.26 on) and SGLang (0.5.23) publish
    "array"            an array: its class name, then its fields in the order above (the form both
                       used before; for consumers that only read that)
`encode_batch` / `decode_batch` are the two ends (`decode_batch` reads either).

The cache appends to a `KVEventRecorder`; the scheduler takes the events once per step and hands
them to the publisher (kv_event_publisher.py) as one batch.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass, fields
from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the three event types (tagged with the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The "map" form: the same events as maps tagged under "type", plus the field vLLM added since
# (`lora_name`, required in its struct, so always sent: null).
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type", tag=True):
    pass


def _map_form(cls: type, extra: tuple = ()) -> type:
    fields_ = [(f.name, f.type) for f in msgspec.structs.fields(cls)] + list(extra)
    return msgspec.defstruct(f"{cls.__name__}Map", fields_, bases=(_MapEvent,), tag=cls.__name__)


_BlockStoredMap = _map_form(BlockStored, (("lora_name", str | None),))
_BlockRemovedMap = _map_form(BlockRemoved)
_AllBlocksClearedMap = _map_form(AllBlocksCleared)


class _MapBatch(EventBatch):
    events: list[_BlockStoredMap | _BlockRemovedMap | _AllBlocksClearedMap]  # type: ignore[valid-type]


_TO_MAP = {BlockStored: _BlockStoredMap, BlockRemoved: _BlockRemovedMap, AllBlocksCleared: _AllBlocksClearedMap}
_FROM_MAP = {v: k for k, v in _TO_MAP.items()}
EVENT_FORMATS = ("array", "map")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_map_decoder = msgspec.msgpack.Decoder(_MapBatch)


def _to_map(event: Any) -> Any:
    extra = {"lora_name": None} if isinstance(event, BlockStored) else {}
    return _TO_MAP[type(event)](**msgspec.structs.asdict(event), **extra)


def encode_batch(batch: KVEventBatch, event_format: str = "map") -> bytes:
    if event_format == "map":
        batch = _MapBatch(batch.ts, [_to_map(e) for e in batch.events], batch.data_parallel_rank)
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Either format (a map-form `lora_name` is dropped: it is always null here)."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError:
        batch = _map_decoder.decode(payload)
    events = []
    for e in batch.events:
        fields_ = msgspec.structs.asdict(e)
        fields_.pop("lora_name", None)
        events.append(_FROM_MAP[type(e)](**fields_))
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


def block_hash(parent: int | None, token_ids: list[int]) -> int:
    """The hash of one block (see the module docstring)."""
    h = hashlib.sha256()
    if parent is not None:
        h.update(parent.to_bytes(8, "big", signed=True))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def chain_hashes(parent: int | None, token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of the consecutive blocks of `token_ids` (a multiple of `block_size`) below `parent`."""
    out: list[int] = []
    for start in range(0, len(token_ids), block_size):
        parent = block_hash(parent, token_ids[start: start + block_size])
        out.append(parent)
    return out


class KVEventRecorder:
    """Collects the events of one prefix cache between two `take` calls. Not thread-safe (the
    scheduler loop owns the cache and this recorder)."""

    def __init__(self, block_size: int, medium: str | None):
        self.block_size = block_size
        self.medium = medium
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def stored(self, parent_hash: int | None, hashes: list[int], token_ids: list[int]) -> None:
        if hashes:
            self._events.append(BlockStored(hashes, parent_hash, list(token_ids), self.block_size, None,
                                            self.medium))

    def removed(self, hashes: list[int]) -> None:
        if hashes:
            self._events.append(BlockRemoved(list(hashes), self.medium))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]        # what came before the flush no longer matters

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self._events = self._events, []
        return events


def make_batch(events: list, dp_rank: int | None) -> KVEventBatch:
    return KVEventBatch(time.time(), events, dp_rank)


# ------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class KVEventsConfig:
    """`--kv-events-config`, a JSON object with vLLM's / SGLang's field names."""

    publisher: str = "null"               # "zmq" publishes; "null" records nothing
    endpoint: str = "tcp://*:5557"        # PUB socket: bound if it has `*`, `::`, ipc:// or inproc://, else connected
    replay_endpoint: str | None = None    # ROUTER socket (always bound) answering replay requests
    topic: str = ""                       # first frame of every message
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 100_000                    # PUB send high-water mark
    max_queue_size: int = 100_000         # batches waiting for the publisher thread (more are dropped)
    enable_kv_cache_events: bool = True   # vLLM's switch; false turns the publisher off
    event_format: str = "map"             # radixlm's: "map" (vLLM >= 0.26, SGLang 0.5.23) or "array" (older)

    @staticmethod
    def from_json(text: str) -> KVEventsConfig:
        """Parses and checks the flag's value; raises ValueError with the reason."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        names = {f.name for f in fields(KVEventsConfig)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(names)}")
        config = KVEventsConfig(**raw)
        config.check()
        return config

    def check(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError("--kv-events-config: endpoint must be a ZeroMQ address such as tcp://*:5557")
        for name in ("replay_endpoint", "topic"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        if self.event_format not in EVENT_FORMATS:
            raise ValueError(f"--kv-events-config: event_format must be one of {list(EVENT_FORMATS)}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq" and self.enable_kv_cache_events
