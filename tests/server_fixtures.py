"""The real radixlm server for tests: a fixture factory over radixlm.testing.server.

    server = server_fixture(*SERVER_FLAGS, api_key=KEY)          # at module level: a module fixture
    with start_server(model_path, "--max-total-tokens", "4096") as server:   # one-off servers
        httpx.get(server.url("/health"))

`start_server` waits until the server logged its ready line (its 1-token warm-up generation
worked), and fails with the log's tail if the process dies or is not ready in time. `stop()`
sends SIGTERM and then SIGKILL after a grace period, and returns the exit code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixlm.testing.server import (  # noqa: F401 - re-exported for the tests
    READY_LINE,
    ServerProcess,
    child_pids,
    descendant_pids,
    free_port,
    launch_server_process,
    pid_alive,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def start_server(model_path: str | None, *extra_args: str, api_key: str | None = None, timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Launches `python -m radixlm.launch_server` on 127.0.0.1:<free port> and waits until ready."""
    return launch_server_process(model_path, *extra_args, api_key=api_key, timeout=timeout, env=env,
                                 cwd=REPO_ROOT)


def server_fixture(*flags: str, model: str | Callable[[], str] = "llama_path", api_key: str | None = None,
                   env: dict[str, str] | None = None, clean_exit: bool = False, timeout: float = 300.0,
                   more_flags: Callable[[pytest.FixtureRequest], Sequence[str]] | None = None) -> Any:
    """A module-scoped server fixture (assign it to the fixture's name): the model is the fixture
    named `model` (or `model()` when callable), with `flags` (plus `more_flags(request)`, for flags
    that come from other fixtures). With `clean_exit`, teardown asserts the server exited 0 on SIGTERM."""

    @pytest.fixture(scope="module")
    def server(request: pytest.FixtureRequest):
        extra = tuple(more_flags(request)) if more_flags is not None else ()
        path = model() if callable(model) else request.getfixturevalue(model)
        srv = start_server(path, *flags, *extra, api_key=api_key, env=env, timeout=timeout)
        yield srv
        code = srv.stop()
        if clean_exit:
            assert code == 0, f"server exited with {code} on SIGTERM:\n{srv.log_tail()}"

    return server


def openai_client(server: ServerProcess, timeout: float = 120.0) -> Any:
    """An `openai.OpenAI` client for the server's /v1 routes, without retries (for a server started
    without an API key)."""
    import openai

    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=timeout)


def kv_state(server: ServerProcess) -> dict:
    """The scheduler's internal state from /get_server_info (KV free/evictable/total, req rows)."""
    return server.get_json("/get_server_info")["internal_states"][0]


def wait_kv_free(server: ServerProcess, timeout: float = 15.0) -> dict:
    """Polls until every KV slot is free or evictable and every req row is free; returns the state."""
    deadline = time.monotonic() + timeout
    state: dict = {}
    while time.monotonic() < deadline:
        state = kv_state(server)
        if state.get("kv_fully_free") and state.get("req_rows_free") == state.get("req_rows_total"):
            return state
        time.sleep(0.2)
    raise AssertionError(f"KV or req rows not free after {timeout:.0f} s: {state}")


def metric_values(server: ServerProcess) -> dict[str, float]:
    """`/metrics` parsed with prometheus_client: sample name -> value (labels summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url("/metrics"), timeout=30)
    r.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values
