"""The server tells its operator what it does: after a few requests and a bad one, its log holds a
prefill line, a decode line and the 400 line (route, status, message), and never a prompt unless
--log-requests. --enable-access-log adds uvicorn's per-request lines (off by default: see
server_lifecycle, `access_log=args.enable_access_log`)."""

from __future__ import annotations

import re
import time

import httpx

from tests.server_fixtures import ServerProcess, server_fixture

PROMPT = "SECRET-PROMPT-TEXT def fibonacci(n):"
server = server_fixture("--max-total-tokens", "4096", "--decode-log-interval", "2", "--log-level", "info",
                        "--enable-access-log")


def wait_for_log(server: ServerProcess, pattern: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, server.log())
        if match:
            return match.group(0)
        time.sleep(0.2)
    raise AssertionError(f"no log line matching {pattern!r}:\n{server.log_tail()}")


def test_batch_lines_and_error_line(server: ServerProcess) -> None:
    for _ in range(2):
        r = httpx.post(server.url("/generate"), timeout=120,
                       json={"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        assert r.status_code == 200, r.text
    bad = httpx.post(server.url("/generate"), timeout=60,
                     json={"text": PROMPT, "sampling_params": {"max_new_tokens": -3}})
    assert bad.status_code == 400
    message = bad.json()["error"]["message"]
    wait_for_log(server, r"Prefill batch\. #new-seq: 1, #new-token: \d+, #cached-token: \d+")
    wait_for_log(server, r"Decode batch\. #running-req: \d+, #token: \d+, token usage: [\d.]+, "
                         r"gen throughput \(token/s\): [\d.]+")
    line = wait_for_log(server, r".*HTTP 400 POST /generate: .*")
    assert message in line
    assert "SECRET-PROMPT-TEXT" not in server.log()      # no --log-requests: no prompt in the log


def test_access_log_flag(server: ServerProcess) -> None:
    r = httpx.get(server.url("/get_model_info"), timeout=30)
    assert r.status_code == 200
    wait_for_log(server, r'"GET /get_model_info HTTP/1\.1" 200')
