"""SGLang's Model Gateway (`sglang-router`, the `test` extra) in front of radixlm workers, for tests
and benchmarks.

    with launch_gateway([a.base_url, b.base_url], policy="cache_aware") as gw:
        httpx.post(gw.url("/generate"), json={"text": "hi"})
        gw.wait_healthy({a.base_url})          # after a worker died: the health check noticed

`launch_gateway` runs `python -m sglang_router.launch_router` on a free loopback port (its own
Prometheus endpoint too), logging to a temp file, with a 1 s health-check interval so tests see a
dead worker within seconds, and waits until every worker is registered and healthy. `stop()`
terminates it (SIGKILL after a grace period).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from radixlm.runtime.utils import free_port
from radixlm.testing.server import new_log_file

__all__ = ["GatewayProcess", "launch_gateway"]


class GatewayProcess:
    """A running gateway: its URL, process and log."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, worker_urls: list[str]):
        self.proc = proc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.worker_urls = list(worker_urls)

    def url(self, path: str = "") -> str:
        return self.base_url + path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def workers(self) -> dict[str, bool]:
        """Worker URL -> healthy, as the gateway sees them (`GET /workers`)."""
        body = httpx.get(self.url("/workers"), timeout=10).json()
        return {w["url"]: bool(w.get("is_healthy")) for w in body.get("workers", [])}

    def wait_healthy(self, healthy: set[str], timeout: float = 60.0) -> None:
        """Blocks until exactly the workers in `healthy` are registered and healthy."""
        deadline = time.monotonic() + timeout
        seen: dict[str, bool] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                seen = self.workers()
            except httpx.HTTPError:
                seen = {}
            if {url for url, ok in seen.items() if ok} == healthy:
                return
            time.sleep(0.2)
        raise TimeoutError(f"gateway workers {seen}, wanted healthy {healthy}:\n{self.log_tail()}")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_gateway(worker_urls: list[str], policy: str = "cache_aware", *extra_args: str,
                   timeout: float = 60.0) -> GatewayProcess:
    """Starts the gateway in front of `worker_urls` and waits until all of them are healthy."""
    port = free_port()
    log_fd, log_name = new_log_file(f"sglang-router-{port}")
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
           "--health-success-threshold", "1", "--log-level", "warn", *extra_args]
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    gateway = GatewayProcess(proc, port, log_name, worker_urls)
    try:
        gateway.wait_healthy(set(worker_urls), timeout)
    except BaseException:
        gateway.stop()
        raise
    return gateway
