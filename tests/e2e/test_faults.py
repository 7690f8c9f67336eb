"""Overload and faults against the real server.

Overload (one server with a small queue, a body limit and a server-wide timeout):
  * `--max-queued-requests N`: once the requests in flight exceed what the scheduler runs at once
    (`--max-running-requests`) by N, new requests get 503 + `Retry-After` with the OpenAI error
    body, on the native and the OpenAI routes; the running ones finish untouched;
  * `--max-request-bytes`: an oversize body gets 413 before any parsing (invalid JSON still gets
    413, and so does a chunked body that declares no length);
  * the per-request `timeout` field and `--request-timeout` abort with finish_reason
    `{"type": "abort", "message": "timeout"}`.

Faults (a fresh server each): SIGKILL the scheduler, or the detokenizer, while streaming and
non-streaming requests are in flight. Every in-flight request must end with an error within 5 s
(never hang, never look like a normal finish), the server must exit non-zero within 5 s (or at
least report unhealthy), and no process of the server's tree may survive it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.server_fixtures import (
    ServerProcess,
    descendant_pids,
    pid_alive,
    server_fixture,
    start_server,
    wait_kv_free,
)

BASE_FLAGS = ("--device", "cpu", "--dtype", "float32")
# The server-wide timeout must be shorter than LONG_TOKENS decode steps take: with the one-call decoder
# the tiny fp32 model on one thread decodes 2000 tokens in under 0.5 s on an idle Zen 5 core.
MAX_RUNNING, MAX_QUEUED, MAX_BYTES, REQUEST_TIMEOUT = 2, 2, 4096, 0.15
OVERLOAD_FLAGS = (*BASE_FLAGS, "--context-length", "2048", "--max-total-tokens", "8192",
                  "--max-running-requests", str(MAX_RUNNING), "--max-queued-requests", str(MAX_QUEUED),
                  "--max-request-bytes", str(MAX_BYTES), "--request-timeout", str(REQUEST_TIMEOUT))
FAULT_FLAGS = (*BASE_FLAGS, "--context-length", "2048", "--max-total-tokens", "8192")
# one torch thread in the scheduler: on a shared 2-core machine two spinning OpenMP threads make a
# tiny model's decode step up to 100x slower (MACHINE_FACTS.md, Noise)
ONE_THREAD = {"RADIXLM_NUM_THREADS": "1"}
DEATH_LIMIT_S = 5.0
LONG_TOKENS = 2000                # at >= 0.1 ms per decode step, these outlast REQUEST_TIMEOUT
LONG = {"max_new_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
TIMEOUT_REASON = {"type": "abort", "message": "timeout"}


server = server_fixture(*OVERLOAD_FLAGS, env=ONE_THREAD, clean_exit=True)


def sse_data(text: str) -> list:
    events = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_error_body(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    return err


# ---------------------------------------------------------------------- queue limit
def _in_flight(server: ServerProcess) -> int:
    return int(server.get_json("/get_server_info")["num_running_requests"])


class LiveStream:
    """A /generate stream read in the background; `meta` is the latest chunk's meta_info."""

    def __init__(self, rid: str, new_tokens: int):
        self.body = {"text": f"queued {rid}:", "rid": rid, "stream": True, "timeout": 600,
                     "sampling_params": {**LONG, "max_new_tokens": new_tokens}}
        self.meta: dict = {"completion_tokens": 0}

    async def run(self, client: httpx.AsyncClient, server: ServerProcess) -> dict:
        async with client.stream("POST", server.url("/generate"), json=self.body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    self.meta = json.loads(line[len("data: "):])["meta_info"]
        return self.meta


def _refused_requests(server: ServerProcess) -> None:
    """While the queue is full: native, native streaming and OpenAI requests all get 503."""
    small = {"text": "one more", "sampling_params": {"max_new_tokens": 2}}
    for body in (small, {**small, "stream": True}):
        r = httpx.post(server.url("/generate"), json=body, timeout=30)
        err = assert_error_body(r, 503)
        assert "overloaded" in err["message"] and err["type"] == "server_error"
        assert int(r.headers["retry-after"]) >= 1
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.status_code == 503 and info.value.response.headers.get("retry-after")


async def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_queue_limit_refuses_with_503_and_running_finish(server: ServerProcess) -> None:
    """Two long requests run (max running 2), two short ones wait (max queued 2): a fifth is
    refused. The long ones keep generating through the refusals (then we abort them); the
    queued ones run to their full length."""
    running = [LiveStream(f"long-{i}", LONG_TOKENS) for i in range(MAX_RUNNING)]
    queued = [LiveStream(f"short-{i}", 16) for i in range(MAX_QUEUED)]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(s.run(client, server)) for s in running]
            await _wait_for(lambda: all(s.meta["completion_tokens"] > 0 for s in running), "the long requests")
            tasks += [asyncio.create_task(s.run(client, server)) for s in queued]
            await _wait_for(lambda: _in_flight(server) >= len(tasks), "four requests in flight")
            await asyncio.to_thread(_refused_requests, server)
            seen = [s.meta["completion_tokens"] for s in running]
            await _wait_for(lambda: all(s.meta["completion_tokens"] > n + 3 for s, n in zip(running, seen, strict=True)),
                            "the running requests to go on generating")
            for s in running:
                r = await client.post(server.url("/abort_request"), json={"rid": s.body["rid"]})
                assert r.status_code == 200, r.text
            return await asyncio.gather(*tasks)

    metas = asyncio.run(run())
    for meta in metas[:MAX_RUNNING]:   # aborted by us, or (on a fast machine) finished in full
        assert meta["finish_reason"]["type"] == "abort" or meta["completion_tokens"] == LONG_TOKENS, meta
    for meta in metas[MAX_RUNNING:]:
        assert meta["finish_reason"] == {"type": "length", "length": 16}, meta["finish_reason"]
    r = httpx.post(server.url("/generate"), json={"text": "after", "sampling_params": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 200, r.text
    wait_kv_free(server)


def test_queue_limit_counts_each_sample(server: ServerProcess) -> None:
    """n > 1 and batches count one slot per sub-request; an idle server still takes a big batch."""
    big = {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2, "n": 2}}
    r = httpx.post(server.url("/generate"), json=big, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()) == 6


# ---------------------------------------------------------------------- request size
def test_oversize_body_is_413_before_parsing(server: ServerProcess) -> None:
    garbage = b"{" + b"x" * MAX_BYTES             # not JSON: parsing it first would give 400
    err = assert_error_body(httpx.post(server.url("/generate"), content=garbage, timeout=30), 413)
    assert str(MAX_BYTES) in err["message"]

    def chunks():                                   # chunked transfer: no Content-Length to trust
        for _ in range(8):
            yield b"y" * 1024

    r = httpx.post(server.url("/v1/chat/completions"), content=chunks(),
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert_error_body(r, 413)
    big_chat = {"model": "m", "messages": [{"role": "user", "content": "z" * MAX_BYTES}]}
    assert_error_body(httpx.post(server.url("/v1/chat/completions"), json=big_chat, timeout=30), 413)
    ok = httpx.post(server.url("/generate"), json={"text": "fits", "sampling_params": {"max_new_tokens": 1}},
                    timeout=60)
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------- timeouts
def test_per_request_timeout_aborts(server: ServerProcess) -> None:
    body = {"text": "slow", "timeout": 0.2, "sampling_params": LONG}
    r = httpx.post(server.url("/generate"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == TIMEOUT_REASON
    assert meta["completion_tokens"] < LONG_TOKENS
    r = httpx.post(server.url("/generate"), json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert sse_data(r.text)[-1]["meta_info"]["finish_reason"] == TIMEOUT_REASON
    wait_kv_free(server)


def test_server_request_timeout_aborts(server: ServerProcess) -> None:
    started = time.monotonic()
    r = httpx.post(server.url("/generate"), json={"text": "slow", "sampling_params": LONG}, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["finish_reason"] == TIMEOUT_REASON, meta
    assert time.monotonic() - started >= REQUEST_TIMEOUT
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "slow"}],
                                         max_tokens=LONG_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "abort"
    assert out.usage.completion_tokens < LONG_TOKENS
    wait_kv_free(server)


# ---------------------------------------------------------------------- child faults
def bound_ipc_endpoints(pid: int) -> set[str]:
    """The file names of the unix sockets `pid` has bound (`scheduler`, `detokenizer`, ...)."""
    inode_to_path = {}
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8:
                inode_to_path[parts[6]] = parts[7]
    names = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inode_to_path:
            names.add(os.path.basename(inode_to_path[link[8:-1]]))
    return names


def child_with_endpoint(server: ServerProcess, endpoint: str) -> int:
    for pid in descendant_pids(server.proc.pid):
        try:
            if endpoint in bound_ipc_endpoints(pid):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no child process of the server binds the '{endpoint}' endpoint")


@dataclass
class Outcome:
    kind: str            # "error": the client was told; "finished": a normal end; "hang": no answer
    ended: float
    detail: str = ""


async def _stream_until_end(client: httpx.AsyncClient, server: ServerProcess, i: int,
                            started: asyncio.Event) -> Outcome:
    body = {"text": f"fault {i}", "stream": True, "timeout": 600, "sampling_params": LONG}
    lines: list[str] = []
    try:
        async with client.stream("POST", server.url("/generate"), json=body) as r:
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    started.set()
    except httpx.TimeoutException:
        return Outcome("hang", time.monotonic(), "\n".join(lines[-2:]))
    except httpx.TransportError as e:          # the connection dropped mid-stream: an error too
        return Outcome("error", time.monotonic(), repr(e))
    data = [ln for ln in lines if ln.startswith("data: {")]
    failed = any('"error"' in ln for ln in data) or "data: [DONE]" not in lines
    return Outcome("error" if failed else "finished", time.monotonic(), (data or ["<no data>"])[-1][:200])


async def _plain_until_end(client: httpx.AsyncClient, server: ServerProcess, i: int) -> Outcome:
    body = {"text": f"plain {i}", "timeout": 600, "sampling_params": LONG}
    try:
        r = await client.post(server.url("/generate"), json=body)
    except httpx.TimeoutException:
        return Outcome("hang", time.monotonic())
    except httpx.TransportError as e:
        return Outcome("error", time.monotonic(), repr(e))
    return Outcome("error" if r.status_code >= 500 else "finished", time.monotonic(), r.text[:200])


def _run_and_kill(server: ServerProcess, target: int) -> tuple[list[Outcome], float]:
    """Starts 4 streams and 2 plain requests, SIGKILLs `target` once every stream has produced
    output, and waits for all six; returns their outcomes and the time of the kill."""

    async def run() -> tuple[list[Outcome], float]:
        timeout = httpx.Timeout(DEATH_LIMIT_S * 3, connect=10)
        async with httpx.AsyncClient(timeout=timeout) as client:
            events = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(_stream_until_end(client, server, i, ev)) for i, ev in enumerate(events)]
            tasks += [asyncio.create_task(_plain_until_end(client, server, i)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), 120)
            os.kill(target, signal.SIGKILL)
            killed_at = time.monotonic()
            return list(await asyncio.gather(*tasks)), killed_at

    return asyncio.run(run())


def _assert_down_or_unhealthy(server: ServerProcess, kill_time: float) -> None:
    """The server exits non-zero within the limit or, failing that, /health reports it unhealthy."""
    try:
        code = server.proc.wait(max(kill_time + DEATH_LIMIT_S - time.monotonic(), 0.1))
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: still running
        code = None
    if code is not None:
        assert code != 0, f"the server exited with 0 after a child died:\n{server.log_tail()}"
        return
    r = httpx.get(server.url("/health"), timeout=5)
    assert r.status_code != 200, f"the server still reports healthy {DEATH_LIMIT_S} s after a child died"


def _assert_no_survivors(tree: list[int], grace: float = 5.0) -> None:
    deadline = time.monotonic() + grace
    while [p for p in tree if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in tree if pid_alive(p)]
    assert not survivors, f"orphaned processes of the server: {survivors}"


@pytest.mark.parametrize("endpoint", ["scheduler", "detokenizer"])
def test_child_killed_mid_traffic(llama_path: str, endpoint: str) -> None:
    srv = start_server(llama_path, *FAULT_FLAGS, env=ONE_THREAD)
    try:
        target = child_with_endpoint(srv, endpoint)
        tree = descendant_pids(srv.proc.pid)
        assert target in tree and len(tree) >= 2, tree
        outcomes, kill_time = _run_and_kill(srv, target)
        for o in outcomes:
            assert o.kind == "error", f"an in-flight request did not fail cleanly: {o}"
            assert o.ended - kill_time < DEATH_LIMIT_S, f"a request took {o.ended - kill_time:.1f} s to fail"
        _assert_down_or_unhealthy(srv, kill_time)
        print(f"\n{endpoint} killed: requests failed after {max(o.ended for o in outcomes) - kill_time:.2f} s "
              f"({', '.join(o.detail[:60] for o in outcomes)}); server exit code {srv.proc.poll()}")
        srv.stop()
        _assert_no_survivors(tree)
    finally:
        srv.stop()


# ---------------------------------------------------------------------- the admission rule itself
def test_admission_rule() -> None:
    from radixlm.runtime.managers.admission_control import AdmissionControl, OverloadedError

    rule = AdmissionControl(max_queued=2, capacity=4)
    rule.check(in_flight=0, incoming=50)                 # an idle server takes anything
    rule.check(in_flight=5, incoming=1)                  # 6 in flight: 2 queued
    with pytest.raises(OverloadedError) as info:
        rule.check(in_flight=6, incoming=1)              # 7 in flight: 3 queued
    assert info.value.status_code == 503 and info.value.headers["Retry-After"] == "1"
    with pytest.raises(OverloadedError):
        rule.check(in_flight=1, incoming=6)              # an n=6 request counts 6
    AdmissionControl(max_queued=None, capacity=1).check(in_flight=10**6, incoming=10**6)
    from radixlm.runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="max-queued-requests"):
        ServerArgs(max_queued_requests=-1).validate()
