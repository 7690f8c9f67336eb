"""The real radixlm server as a child process, for tests, benchmarks and `radixlm.Runtime`.

    with launch_server_process(model_path, "--max-total-tokens", "4096") as server:
        httpx.get(server.url("/health"))

`launch_server_process` starts `python -m radixlm.launch_server` on a free loopback port, logging
to a temp file, and waits until the server is ready: its READY_LINE is in the log (the warm-up
generation worked), or, with `ready="health"` (quiet log levels hide that line), `/health` answers
200. It fails with the log's tail if the process exits first or is not ready in time. `stop()`
sends SIGTERM, waits, then SIGKILLs the server and every process it started, and returns the
server's exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from radixlm.runtime.utils import READY_LINE, WORKER_READY_LINE, free_port

__all__ = ["READY_LINE", "ServerProcess", "child_pids", "descendant_pids", "free_port", "launch_server_process",
           "pid_alive", "server_cli_args"]


# the log files of the servers (and gateways) this process started: a passing test session removes
# them (tests/conftest.py), and only them, so that sessions running side by side keep each other's
LOG_FILES: list[Path] = []


def new_log_file(prefix: str) -> tuple[int, Path]:
    """A fresh $TMPDIR/<prefix>-*.log (fd, path), recorded in LOG_FILES."""
    fd, name = tempfile.mkstemp(prefix=f"{prefix}-", suffix=".log")
    LOG_FILES.append(Path(name))
    return fd, Path(name)


class ServerProcess:
    """A running server: its base URL, API key, process and log file."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, api_key: str | None = None,
                 host: str = "127.0.0.1", command: list[str] | None = None):
        self.proc = proc
        self.port = port
        self.base_url = f"http://{host}:{port}"
        self.log_path = Path(log_path)
        self.api_key = api_key
        self.command = command or []

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

    def wait_ready(self, timeout: float, ready: str = "log") -> None:
        """Blocks until ready (`ready`: "log" for READY_LINE, "health" for /health 200, "worker" for
        a multi-node worker's WORKER_READY_LINE, "none" not at all); on failure stops the server and
        raises RuntimeError (it exited) or TimeoutError."""
        if ready == "none":
            return
        line = WORKER_READY_LINE if ready == "worker" else READY_LINE
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if line in self.log() or (ready == "health" and self._healthy()):
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url("/health"), timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds; then SIGKILLs any process the server started
        that is still alive. Returns the server's exit code. Safe to call twice."""
        tree = descendant_pids(self.proc.pid) if self.alive() else []
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in tree:
            if pid_alive(pid):
                _kill(pid)
        return self.proc.returncode

    def get_json(self, path: str, timeout: float = 30.0) -> dict:
        import httpx

        r = httpx.get(self.url(path), headers=self.headers, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server_process(model_path: str | None, *extra_args: str, api_key: str | None = None,
                          host: str = "127.0.0.1", port: int | None = None, timeout: float = 180.0,
                          env: dict[str, str] | None = None, cwd: str | Path | None = None,
                          ready: str = "log", new_session: bool = False, log_prefix: str = "radixlm-server"
                          ) -> ServerProcess:
    """Starts `python -m radixlm.launch_server` (no --model-path when `model_path` is None: the demo
    model) and waits until ready (see ServerProcess.wait_ready). `new_session` puts the server in
    its own process group (Ctrl-C in the caller's terminal does not reach it)."""
    port = port or free_port(host)
    log_fd, log_name = new_log_file(f"{log_prefix}-{port}")
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--host", host, "--port", str(port), *extra_args]
    if model_path is not None:
        cmd[3:3] = ["--model-path", model_path]
    if api_key:
        cmd += ["--api-key", api_key]
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=None if cwd is None else str(cwd), env=child_env, start_new_session=new_session)
    os.close(log_fd)
    server = ServerProcess(proc, port, log_name, api_key, host, cmd)
    server.wait_ready(timeout, ready)
    return server


def server_cli_args(server_args: dict[str, Any]) -> list[str]:
    """`{"model_path": "m", "disable_radix_cache": True}` -> `["--model-path", "m", "--disable-radix-cache"]`."""
    out: list[str] = []
    for name, value in server_args.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        else:
            out += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return out


# ----------------------------------------------------------------- process trees (/proc, Linux)
def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (empty where /proc is missing)."""
    out: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`."""
    return [p for p, parent in _parents().items() if parent == pid]


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid`."""
    children: dict[int, list[int]] = {}
    for p, parent in _parents().items():
        children.setdefault(parent, []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        if os.path.isdir("/proc"):
            return False
    try:                    # no /proc: ask the kernel
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
