"""Boring IPC: ZMQ PUSH/PULL over `ipc://` paths in a private temp dir, pickled dataclasses.

PortArgs names the three one-way channels of a request's path (README, "How a request flows"):

    tokenizer --scheduler_input--> scheduler --detokenizer_input--> detokenizer --tokenizer_input--> tokenizer

With `--dp-size N` every replica gets its own scheduler input (`scheduler_input_for`); all replicas push
into the one detokenizer. The receiving end binds, the sending end connects, so processes may start
in any order: a PUSH socket queues messages until its peer binds. High-water marks are off
(unbounded queues), so a send never blocks and never drops a message.
"""

from __future__ import annotations

import pickle
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio


@dataclass(frozen=True)
class PortArgs:
    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str
    ipc_dir: str

    @staticmethod
    def new() -> PortArgs:
        d = tempfile.mkdtemp(prefix="radixlm-")
        return PortArgs(scheduler_input=f"ipc://{d}/scheduler", detokenizer_input=f"ipc://{d}/detokenizer",
                        tokenizer_input=f"ipc://{d}/tokenizer", ipc_dir=d)

    def scheduler_input_for(self, dp_rank: int) -> str:
        """The scheduler input endpoint of one data-parallel replica (rank 0 keeps the plain name)."""
        base = f"ipc://{self.ipc_dir}/scheduler"
        return base if dp_rank == 0 else f"{base}-dp{dp_rank}"

    def cleanup(self) -> None:
        """Removes the socket files and the private directory (idempotent)."""
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _dumps(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _new_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class Pusher:
    """Sending end; connects (the receiver binds). `send` never blocks (no high-water mark)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = _new_socket(ctx, zmq.PUSH)
        self.sock.connect(endpoint)

    def send(self, msg: Any) -> None:
        self.sock.send(_dumps(msg), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class Puller:
    """Receiving end; binds its endpoint."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = _new_socket(ctx, zmq.PULL)
        self.sock.bind(endpoint)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """Blocks up to timeout_ms (None: forever); returns None on timeout."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return pickle.loads(self.sock.recv(copy=False).bytes)

    def recv_nowait_all(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(pickle.loads(self.sock.recv(zmq.NOBLOCK, copy=False).bytes))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncPuller:
    """asyncio receiving end (TokenizerManager). The socket may be created outside a running loop."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str):
        self.sock = _new_socket(ctx, zmq.PULL)
        self.sock.bind(endpoint)

    async def recv(self) -> Any:
        return pickle.loads(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncPusher:
    """Sending end for asyncio code. It is a plain (sync) socket: with no high-water mark a PUSH
    send only queues locally, so it never blocks the event loop and cannot fail silently the way a
    fire-and-forget zmq.asyncio future would."""

    def __init__(self, ctx: zmq.Context | zmq.asyncio.Context, endpoint: str):
        sync_ctx = zmq.Context.shadow(ctx.underlying) if isinstance(ctx, zmq.asyncio.Context) else ctx
        self.sock = _new_socket(sync_ctx, zmq.PUSH)
        self.sock.connect(endpoint)

    def send_nowait(self, msg: Any) -> None:
        self.sock.send(_dumps(msg), zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
