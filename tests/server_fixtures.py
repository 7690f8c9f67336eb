"""Start the real radixlm server as a subprocess on a free loopback port, for tests.

    with start_server(model_path, "--max-total-tokens", "4096") as server:
        httpx.get(server.url("/health"))

`start_server` waits until the server logged its ready line (its 1-token warm-up generation
worked), and fails with the log's tail if the process dies or is not ready in time. `stop()`
sends SIGTERM and then SIGKILL after a grace period, and returns the exit code. Test modules
usually wrap it in a module-scoped fixture so one server serves the whole module.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

READY_LINE = "The server is fired up and ready to roll!"
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A running server: its base URL, API key, process and log file."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, api_key: str | None):
        self.proc = proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.api_key = api_key

    def url(self, path: str = "") -> str:
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if READY_LINE in self.log():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds; returns the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def get_json(self, path: str, timeout: float = 30.0) -> dict:
        r = httpx.get(self.url(path), headers=self.headers, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(model_path: str, *extra_args: str, api_key: str | None = None, timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Launches `python -m radixlm.launch_server` on 127.0.0.1:<free port> and waits until ready."""
    port = free_port()
    log_fd, log_name = tempfile.mkstemp(prefix=f"radixlm-server-{port}-", suffix=".log")
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
           "--port", str(port), *extra_args]
    if api_key:
        cmd += ["--api-key", api_key]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), env=child_env)
    os.close(log_fd)
    server = ServerProcess(proc, port, Path(log_name), api_key)
    server.wait_ready(timeout)
    return server


def kv_state(server: ServerProcess) -> dict:
    """The scheduler's internal state from /get_server_info (KV free/evictable/total, req rows)."""
    return server.get_json("/get_server_info")["internal_states"][0]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc (Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


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
