"""The live dashboard: `GET /dashboard` (one self-contained HTML page, no CDN, works offline) and
`GET /dashboard/stats` (the JSON it polls once a second).

The stats come from the scheduler stats every replica pushes while busy (no round trip to the
scheduler per poll); rates (tokens/s, hit rate over time) are computed by the page from the
cumulative counters.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).parent / "static" / "dashboard.html"


def dashboard_stats(tm: Any) -> dict[str, Any]:
    stats = list(getattr(tm, "stats_by_dp_rank", {}).values())
    if not stats and tm.latest_stats is not None:
        stats = [tm.latest_stats]

    def total(name: str) -> float:
        return sum(getattr(s, name) for s in stats)

    max_total = total("max_total_tokens") or tm.scheduler_info.get("max_total_tokens", 0) or 1
    return {
        "time": time.time(),
        "num_running_reqs": total("num_running_reqs"),
        "num_waiting_reqs": total("num_waiting_reqs") + total("num_grammar_queue_reqs"),
        "kv_cache_usage": total("kv_used_tokens") / max_total,
        "radix_cache_tokens": total("kv_evictable_tokens"),
        "max_total_tokens": max_total,
        "prefix_cache_queries": total("prefix_cache_queries"),
        "prefix_cache_hits": total("prefix_cache_hits"),
        "generated_tokens": total("generated_tokens"),
        "num_preemptions": total("num_preemptions"),
        "late_divergence_misses": total("late_divergence_misses"),
        "in_flight_requests": tm.num_running_requests(),
        "dp_size": max(len(stats), 1),
    }


def add_dashboard_routes(app: FastAPI, tm: Any) -> None:
    html = PAGE.read_text(encoding="utf-8")

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(html)

    @app.get("/dashboard/stats")
    async def stats() -> dict[str, Any]:
        return dashboard_stats(tm)
