"""The route a gateway reads load from: `/get_load` (`/model_info` is an alias in http_server.py).

    add_worker_routes(app, state)      state: http_server.ServerState

SGLang's Model Gateway (`sglang-router`) asks each worker for `/model_info` (falling back to
`/get_model_info`) when it registers it, `/health` every health-check interval, and `/get_load` for
the `power_of_two` policy and `GET /get_loads`. `/get_load` answers SGLang's shape: one entry per
data-parallel replica, `{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}`, where
`num_tokens` is the KV tokens held by requests (the gateway sums it as the worker's load). The
figures come from the latest stats each scheduler pushed (a few times a second while busy, once
when it goes idle), so they cost no round trip to the schedulers.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.responses import Response

from .errors import json_response


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


def add_worker_routes(app: FastAPI, state: Any) -> None:
    """Adds `/get_load`."""

    @app.get("/get_load")
    async def get_load() -> Response:
        return json_response(worker_load(state.tm, state.server_args.dp_size))
