"""ZmqEventPublisher: sends KV-event batches (kv_events.py) on a PUB socket, with a replay socket.

Wire protocol (vLLM's):
    live       PUB, three frames: [topic, seq as 8-byte big-endian, msgpack KVEventBatch]
    replay     ROUTER; a REQ (or DEALER, with an empty delimiter frame) sends one frame, the first
               wanted seq as 8-byte big-endian; the answer is one message per buffered batch with
               seq >= it, [topic, seq, payload], then the end marker [b"", -1 as 8-byte signed, b""]
Sequence numbers count batches from 0 per publisher (one per scheduler replica). With `--dp-size
N`, replica r adds r to a tcp endpoint's port (ipc/inproc endpoints get a `_dp{r}` suffix).

One daemon thread owns both sockets: `publish` only puts the batch on a queue (dropped, and
logged once, when the queue is full), so the scheduler never waits on a subscriber.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import zmq

from .kv_events import KVEventRecorder, KVEventsConfig, encode_batch, make_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.05


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of replica `dp_rank`: tcp port + rank, or a `_dp{rank}` suffix."""
    if endpoint is None or dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def make_kv_events(config_json: str | None, page_size: int, device: str, radix_cache: bool, tp_rank: int,
                   dp_rank: int) -> tuple[KVEventRecorder | None, ZmqEventPublisher | None]:
    """The recorder for a scheduler's radix cache and its publisher, or (None, None) when events are
    off, the radix cache is disabled, or this is not TP rank 0 (the other ranks hold the same tree)."""
    if not config_json or not radix_cache or tp_rank != 0:
        return None, None
    config = KVEventsConfig.from_json(config_json)
    if not config.enabled:
        return None, None
    medium = "GPU" if str(device).startswith("cuda") else "CPU"
    return KVEventRecorder(page_size, medium), ZmqEventPublisher(config, dp_rank)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, dp_rank: int = 0):
        self.dp_rank = dp_rank
        self.topic = config.topic.encode()
        self.event_format = config.event_format
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._dropped = 0
        self._ctx = zmq.Context()
        endpoint = offset_endpoint(config.endpoint, dp_rank)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(offset_endpoint(config.replay_endpoint, dp_rank))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay %s, topic %r)", endpoint,
                    offset_endpoint(config.replay_endpoint, dp_rank), config.topic)

    def publish(self, events: list) -> None:
        """Queues one batch of events (a no-op when empty). Never blocks."""
        if not events:
            return
        try:
            self._queue.put_nowait(make_batch(events, self.dp_rank))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                logger.warning("KV events: publisher queue full, batches dropped (subscribers see a seq gap)")

    def shutdown(self, timeout: float = 1.0) -> None:
        """Sends what is queued, then closes the sockets."""
        self._stop.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while not (self._stop.is_set() and self._queue.empty()):
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    batch = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                payload = encode_batch(batch, self.event_format)
                seq = self._next_seq.to_bytes(8, "big")
                self._pub.send_multipart([self.topic, seq, payload])
                self._buffer.append((self._next_seq, payload))
                self._next_seq += 1
        except Exception:  # noqa: BLE001 - a broken publisher must not take the scheduler down
            logger.exception("KV events: publisher thread stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            self._ctx.term()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", b"", END_SEQ, b""])
