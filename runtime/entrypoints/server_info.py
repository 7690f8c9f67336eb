"""What `/get_server_info`, `/get_load` and `Engine.get_server_info()` report, and the startup lines.

    server_info(server_args, tm)   -> args (api_key redacted) + scheduler info + capacity + state
    worker_load(tm, dp_size)       -> SGLang's `/get_load` body, from the latest scheduler stats
    capacity_report(info, ctx)     -> KV bytes per token, pool size, concurrent requests at context
    format_fast_paths(paths, notes) -> the startup block: which fast paths are on, and why
    health_generate(tm)            -> None when a 1-token generation works, else what went wrong

Nothing here holds state; every function reads the running TokenizerManager `tm`.

SGLang's Model Gateway (`sglang-router`) asks each worker for `/model_info` (falling back to
`/get_model_info`) when it registers it, `/health` every health-check interval, and `/get_load` for
the `power_of_two` policy and `GET /get_loads`. `/get_load` answers SGLang's shape: one entry per
data-parallel replica, `{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}`, where
`num_tokens` is the KV tokens held by requests (the gateway sums it as the worker's load). The
figures come from the latest stats each scheduler pushed (a few times a second while busy, once
when it goes idle), so they cost no round trip to the schedulers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

import radixlm

from ..managers.io_struct import GenerateReqInput
from ..server_args import ServerArgs

STATE_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 20.0


def redacted_args(server_args: ServerArgs) -> dict[str, Any]:
    """The server args as a dict, with the API key replaced by "<redacted>" when set."""
    args = dataclasses.asdict(server_args)
    args["api_key"] = None if server_args.api_key is None else "<redacted>"
    return args


async def server_info(server_args: ServerArgs, tm: Any, started_at: float | None = None) -> dict[str, Any]:
    """Asks the scheduler(s) for their internal state (at most STATE_TIMEOUT_S; an error entry
    instead when they do not answer) and merges it with the args, capacity and latest stats."""
    stats = tm.latest_stats
    try:
        state = await asyncio.wait_for(tm.get_internal_state(), STATE_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError) as e:
        state = {"error": f"scheduler state unavailable: {e!r}"}
    info = {**redacted_args(server_args), **tm.scheduler_info, **capacity_report(tm.scheduler_info, tm.context_len),
            "version": radixlm.__version__,
            "scheduler_stats": dataclasses.asdict(stats) if stats is not None else None,
            "internal_states": [state], "num_running_requests": tm.num_running_requests()}
    if started_at is not None:
        info["uptime_s"] = time.time() - started_at
    return info


def worker_load(tm: Any, dp_size: int) -> list[dict[str, int]]:
    """SGLang's `/get_load` body from the schedulers' latest stats (zeros before the first push)."""
    stats = dict(tm.stats_by_dp_rank)
    dp_size = max(dp_size, len(stats), 1)
    out = []
    for rank in range(dp_size):
        s = stats.get(rank)
        waiting = (s.num_waiting_reqs + s.num_grammar_queue_reqs) if s is not None else 0
        running = s.num_running_reqs if s is not None else 0
        out.append({"dp_rank": rank, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                    "num_tokens": s.kv_used_tokens if s is not None else 0})
    return out


def capacity_report(info: dict[str, Any], context_len: int) -> dict[str, Any]:
    """The figures printed at startup and returned by /get_server_info."""
    max_total = int(info.get("max_total_tokens") or 0)
    per_token = int(info.get("kv_bytes_per_token") or 0)
    return {"kv_bytes_per_token": per_token, "max_total_tokens": max_total, "context_len": context_len,
            "kv_pool_bytes": per_token * max_total,
            "max_concurrent_requests_at_context": max_total // context_len if context_len else 0,
            "max_running_requests": info.get("max_running_requests")}


def format_capacity(cap: dict[str, Any]) -> list[str]:
    """The startup capacity report: one line."""
    return [f"KV cache: {cap['max_total_tokens']} tokens ({cap['kv_pool_bytes'] / 2**20:.1f} MiB, "
            f"{cap['kv_bytes_per_token']} bytes per token); context length {cap['context_len']}: at most "
            f"{cap['max_concurrent_requests_at_context']} concurrent requests at full context "
            f"(max running requests: {cap['max_running_requests']})"]


def format_fast_paths(paths: dict[str, str], cpu_notes: list[str]) -> list[str]:
    """The startup block (logged once by the launcher): the first scheduler's fast paths
    (model_executor/fast_paths.py) and the launcher's own CPU lines (threads, tcmalloc preload)."""
    rows = [*paths.items(), *(("threads" if i == 0 else "preload", n) for i, n in enumerate(cpu_notes))]
    width = max((len(k) for k, _ in rows), default=0)
    return ["Fast paths (flags and their RADIXLM_* twins: radixlm-server --help):",
            *(f"  {k.ljust(width)}  {v}" for k, v in rows)]


async def health_generate(tm: Any, timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """Runs a 1-token generation; returns None when it worked, else what went wrong."""
    obj = GenerateReqInput(input_ids=[0], rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                           sampling_params={"max_new_tokens": 1, "temperature": 0.0})

    async def one() -> None:
        stream = tm.generate(obj)
        try:
            await stream.__anext__()
        finally:
            await stream.aclose()

    try:
        await asyncio.wait_for(one(), timeout)
    except asyncio.TimeoutError:
        return f"no generation within {timeout:.0f} s"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
