"""Running a benchmark against a server: `--base-url`, or one started for the run with `--launch`.

The server is started with radixlm.testing.server (the same launcher the tests and the DSL's
`Runtime` use).
"""

from __future__ import annotations

import shlex
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from common_load import LoadMonitor

from radixlm.testing.server import ServerProcess, launch_server_process


def launch_bench_server(server_args: Sequence[str], timeout: float = 300.0) -> ServerProcess:
    """`python -m radixlm.launch_server SERVER_ARGS` on a free port; ready once its ready line is
    logged or /health answers (quiet log levels hide the line)."""
    server = launch_server_process(None, *server_args, timeout=timeout, ready="health",
                                   log_prefix="radixlm-bench-server")
    print(f"launched: {shlex.join(server.command)}  (log: {server.log_path})")
    return server


def run_against_server(args: Any, bench: Callable[[Any, str], Awaitable[dict[str, Any]]]
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs `bench(args, base_url)` against `--base-url`, or against a server started for the run
    with `--launch` (`--model-path`, `--server-args`). Returns (results, load summary)."""
    import asyncio

    server = None
    if args.launch:
        extra = (["--model-path", args.model_path] if args.model_path else []) + shlex.split(args.server_args)
        server = launch_bench_server(extra)
    base_url = server.base_url if server else args.base_url.rstrip("/")
    try:
        with LoadMonitor() as load:
            results = asyncio.run(bench(args, base_url))
    finally:
        if server:
            server.stop()
    results["server_command"] = shlex.join(server.command) if server else None
    return results, load.summary()
