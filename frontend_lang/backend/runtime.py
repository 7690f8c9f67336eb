"""`Runtime`: starts a radixlm server in a child process and talks to it through a RuntimeEndpoint.

    runtime = Runtime(model_path="...", disable_radix_cache=False)   # any ServerArgs field
    sgl.set_default_backend(runtime)
    ...
    runtime.shutdown()          # also runs at interpreter exit

The server runs as `python -m radixlm.launch_server` in its own session (process group), on a
free loopback port; its log goes to a temp file (`runtime.log_path`). `shutdown()` terminates the
whole group (the server and the scheduler/detokenizer processes it started) and waits for it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from radixlm.frontend_lang.backend.runtime_endpoint import RuntimeEndpoint


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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


def descendant_pids(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc; empty where /proc is missing)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class Runtime:
    def __init__(self, model_path: str | None = None, log_level: str = "error", launch_timeout: float = 300.0,
                 api_key: str | None = None, **server_args: Any) -> None:
        from radixlm.runtime.server_args import ServerArgs

        host = server_args.pop("host", "127.0.0.1")
        port = server_args.pop("port", None) or free_port(host)
        args = {"model_path": model_path, "host": host, "port": port, "log_level": log_level,
                "api_key": api_key, **server_args}
        ServerArgs.from_kwargs(**args)  # unknown names fail here, with the server's own message
        self.server_args = args
        self.url = f"http://{host}:{port}"
        self.generate_url = self.url + "/generate"
        self.api_key = api_key
        self.endpoint: RuntimeEndpoint | None = None
        log = tempfile.NamedTemporaryFile(prefix="radixlm-runtime-", suffix=".log", delete=False)
        self.log_path = log.name
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "radixlm.launch_server", *server_cli_args(args)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self.pid: int | None = self._proc.pid
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(launch_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    raise RuntimeError(f"The radixlm server exited during startup:\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise TimeoutError(f"The radixlm server did not become healthy in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    # --------------------------------------------------------------- stopping
    def shutdown(self, timeout: float = 20.0) -> None:
        """Stops the server and every process it started; safe to call twice."""
        if self.endpoint is not None:
            self.endpoint.close()
        proc, self._proc, self.pid = self._proc, None, None
        if proc is None:
            return
        pids = [proc.pid, *descendant_pids(proc.pid)]
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        leftover = [p for p in pids if _alive(p)]
        for pid in leftover:
            _signal(pid, signal.SIGKILL)
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in leftover) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if self.__dict__.get("_proc") is not None:
            self.shutdown()

    # ------------------------------------------------------- convenience API
    def cache_prefix(self, prefix: str) -> None:
        self._endpoint().cache_prefix(prefix)

    def flush_cache(self) -> None:
        self._endpoint().flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self._endpoint().get_server_info()

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        path = self.server_args.get("tokenizer_path") or self._endpoint().model_info.get("tokenizer_path")
        return AutoTokenizer.from_pretrained(path or self.server_args["model_path"])

    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | None = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None) -> str:
        """One native /generate call; returns the JSON text of the answer (as SGLang's Runtime does)."""
        body = {"text": prompt, "sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                "logprob_start_len": logprob_start_len, "top_logprobs_num": top_logprobs_num}
        return json.dumps(self._endpoint().generate_raw({k: v for k, v in body.items() if v is not None}))

    def _endpoint(self) -> RuntimeEndpoint:
        if self.endpoint is None:
            raise RuntimeError("This Runtime has been shut down")
        return self.endpoint


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
