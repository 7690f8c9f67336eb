"""A KV-event subscriber that rebuilds a worker's cache contents from its events alone, for tests
(and as an example of the protocol in runtime/mem_cache/kv_event_publisher.py).

    index = BlockIndex()
    with KVEventSubscriber(endpoint, replay_endpoint, topic="kv-events") as sub:
        sub.replay(index)                       # a late joiner: everything still buffered, from seq 0
        sub.drain(index, until=lambda: ...)     # then the live stream
    index.prefixes()                            # every cached block as its full token prefix

`BlockIndex.apply` is strict: a block stored twice, a parent it never saw, or the removal of an
unknown block raises, so a test that rebuilds the tree also checks that the stream is consistent.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from radixlm.runtime.mem_cache.kv_event_publisher import END_SEQ
from radixlm.runtime.mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hash,
    decode_batch,
)

__all__ = ["BlockIndex", "KVEventSubscriber"]


class BlockIndex:
    """Block hash -> (parent hash, token ids), as a KV-aware router keeps it."""

    def __init__(self, check_hashes: bool = True) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.check_hashes = check_hashes
        self.last_seq = -1
        self.stored = self.removed = 0           # blocks seen stored / removed, for tests

    def apply_batch(self, seq: int, batch: KVEventBatch) -> None:
        assert seq == self.last_seq + 1, f"sequence gap: {self.last_seq} -> {seq}"
        self.last_seq = seq
        for event in batch.events:
            self.apply(event)

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        if isinstance(event, AllBlocksCleared):
            self.blocks.clear()
        elif isinstance(event, BlockStored):
            size, parent = event.block_size, event.parent_block_hash
            assert len(event.token_ids) == size * len(event.block_hashes), event
            assert parent is None or parent in self.blocks, f"unknown parent block {parent}"
            for i, h in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[i * size: (i + 1) * size])
                assert h not in self.blocks, f"block {h} stored twice"
                if self.check_hashes:
                    assert h == block_hash(parent, list(tokens)), "block hash is not the documented one"
                self.blocks[h] = (parent, tokens)
                parent = h
            self.stored += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in self.blocks, f"removed unknown block {h}"
                del self.blocks[h]
            self.removed += len(event.block_hashes)
        else:
            raise AssertionError(f"unknown event {event!r}")

    def prefixes(self) -> set[tuple[int, ...]]:
        """Every block as the whole token sequence from the root to its end."""
        memo: dict[int, tuple[int, ...]] = {}

        def path(h: int) -> tuple[int, ...]:
            if h not in memo:
                parent, tokens = self.blocks[h]
                memo[h] = (path(parent) if parent is not None else ()) + tokens
            return memo[h]

        return {path(h) for h in self.blocks}


class KVEventSubscriber:
    """SUB on the live stream; a DEALER socket on the replay endpoint for each replay."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    def replay(self, index: BlockIndex, timeout: float = 10.0) -> int:
        """Asks for every buffered batch after `index.last_seq` and applies them; returns how many.

        A DEALER socket, so that the many answers to one request can be read (it sends the empty
        delimiter frame a REQ socket would add)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", (index.last_seq + 1).to_bytes(8, "big")])
            count = 0
            while True:
                if not dealer.poll(int(timeout * 1000)):
                    raise TimeoutError("no answer from the replay endpoint")
                frames = dealer.recv_multipart()
                assert len(frames) == 4 and frames[0] == b"", f"bad replay message: {len(frames)} frames"
                _, _topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    return count
                seq = int.from_bytes(seq_bytes, "big")
                if seq > index.last_seq:
                    index.apply_batch(seq, decode_batch(payload))
                    count += 1
        finally:
            dealer.close()

    def drain(self, index: BlockIndex, until: Callable[[], bool], timeout: float = 10.0) -> None:
        """Applies live batches (skipping those the replay already gave) until `until()` holds."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise TimeoutError("the live stream did not reach the expected state")
            if self.sub.poll(50):
                _, seq_bytes, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > index.last_seq:
                    index.apply_batch(seq, decode_batch(payload))

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
