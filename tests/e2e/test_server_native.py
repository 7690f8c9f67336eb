"""The native (SGLang-compatible) routes of the real server: /generate in every form, the info and
control routes, /metrics, 200 concurrent streams, disconnects, and shutdown.

One server (tiny llama, CPU) serves the whole module; the child-death test starts its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx

from tests.helpers import hf_greedy
from tests.server_fixtures import (
    ServerProcess,
    child_pids,
    metric_values,
    pid_alive,
    server_fixture,
    start_server,
    wait_kv_free,
)

SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "512", "--max-total-tokens", "16384")


server = server_fixture(*SERVER_FLAGS, clean_exit=True)


def post(server: ServerProcess, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=timeout)


def sse_events(lines: list[str]) -> list:
    events = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# ---------------------------------------------------------------------- /generate
def test_generate_single_has_meta_info(server: ServerProcess) -> None:
    r = post(server, "/generate", {"text": "def hello(", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"):
        assert key in meta, key
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 8
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert isinstance(out["text"], str)


def test_generate_greedy_matches_hf(server: ServerProcess, llama_path: str) -> None:
    prompt = [5, 17, 99, 230, 41, 7, 300, 12]
    r = post(server, "/generate", {"input_ids": prompt,
                                   "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == hf_greedy(llama_path, prompt, 12)


def test_generate_batch_text_and_ids(server: ServerProcess) -> None:
    params = {"max_new_tokens": 4, "temperature": 0}
    r = post(server, "/generate", {"text": ["import os", "class A:", "x = 1"], "sampling_params": params})
    assert r.status_code == 200, r.text
    assert isinstance(r.json(), list) and len(r.json()) == 3
    r = post(server, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [params, params]})
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [3, 2]


def test_generate_n_returns_n_items(server: ServerProcess) -> None:
    r = post(server, "/generate", {"text": "for i in", "sampling_params": {"max_new_tokens": 4, "n": 2,
                                                                          "temperature": 0.9}})
    assert r.status_code == 200, r.text
    assert isinstance(r.json(), list) and len(r.json()) == 2


def test_generate_stream_is_cumulative(server: ServerProcess) -> None:
    body = {"text": "while True:", "stream": True, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    with httpx.stream("POST", server.url("/generate"), json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(list(r.iter_lines()))
    texts = [c["text"] for c in chunks]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert counts == sorted(counts) and counts[-1] == len(chunks[-1]["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    whole = post(server, "/generate", {**body, "stream": False}).json()
    assert whole["text"] == texts[-1]


def test_generate_logprobs_with_start_len(server: ServerProcess) -> None:
    ids = [11, 12, 13, 14, 15, 16]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    meta = post(server, "/generate", body).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(ids)
    assert meta["input_token_logprobs"][0][0] is None
    assert [t[1] for t in meta["input_token_logprobs"]] == ids
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 3
    for triple in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert isinstance(triple[2], str) and triple[2]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    meta = post(server, "/generate", {**body, "logprob_start_len": 4}).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(ids) - 4


def test_generate_prefill_only(server: ServerProcess) -> None:
    ids = [21, 22, 23, 24, 25]
    r = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["meta_info"]["completion_tokens"] == 0 and out["output_ids"] == []


def test_generate_stop_string_reports_matched(server: ServerProcess) -> None:
    body = {"text": "def main():", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                        "ignore_eos": True}}
    text = post(server, "/generate", body).json()["text"]
    stop = text[3:5]
    assert len(stop) == 2
    body["sampling_params"]["stop"] = [stop]
    out = post(server, "/generate", body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.index(stop)]


# ---------------------------------------------------------------------- info and control routes
def test_info_routes(server: ServerProcess, llama_path: str) -> None:
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/health_generate"), timeout=60).status_code == 200
    info = server.get_json("/get_model_info")
    assert info["model_path"] == llama_path and info["is_generation"] is True
    assert "tokenizer_path" in info
    si = server.get_json("/get_server_info")
    assert set(server.get_json("/server_info")) == set(si)
    assert si["kv_bytes_per_token"] > 0 and si["max_total_tokens"] > 0
    assert si["max_concurrent_requests_at_context"] == si["max_total_tokens"] // 512
    assert "kv_free_tokens" in si["internal_states"][0]
    assert si["api_key"] is None
    log = server.log()
    assert "bytes per token" in log and "concurrent requests at full context" in log


def test_flush_cache_refused_while_running(server: ServerProcess) -> None:
    wait_kv_free(server)
    assert httpx.post(server.url("/flush_cache"), timeout=30).status_code == 200
    body = {"text": "x", "rid": "long-flush", "stream": True,      # 8 x 480 tokens: still running below
            "sampling_params": {"max_new_tokens": 480, "ignore_eos": True, "n": 8}}
    with httpx.stream("POST", server.url("/generate"), json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(lines)
        refused = httpx.post(server.url("/flush_cache"), timeout=30)
        assert refused.status_code == 400, refused.text
        assert "running" in refused.json()["error"]["message"]
        assert post(server, "/abort_request", {"rid": "long-flush"}).status_code == 200
        chunks = sse_events([first, *lines])
    last = {c["index"]: c["meta_info"]["finish_reason"] for c in chunks}
    assert len(last) == 8 and {r["type"] for r in last.values()} == {"abort"}, last
    wait_kv_free(server)


def test_metrics_parse_and_prefix_hits_grow(server: ServerProcess) -> None:
    before = metric_values(server)
    for name in ("radixlm:num_requests_running", "radixlm:num_requests_waiting", "radixlm:kv_cache_usage",
                 "radixlm:radix_cache_tokens", "radixlm:max_total_tokens", "radixlm:prompt_tokens_total",
                 "radixlm:generation_tokens_total", "radixlm:num_preemptions_total",
                 "radixlm:time_to_first_token_seconds_count", "radixlm:inter_token_latency_seconds_count",
                 "radixlm:e2e_request_latency_seconds_count", "radixlm:prefix_cache_queries_total"):
        assert name in before, name
    shared = list(range(100, 164))
    for tail in ([3, 4], [5, 6], [7, 8]):
        post(server, "/generate", {"input_ids": shared + tail, "sampling_params": {"max_new_tokens": 2}})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = metric_values(server)
        if after["radixlm:prefix_cache_hits_total"] - before.get("radixlm:prefix_cache_hits_total", 0) >= 64:
            break
        time.sleep(0.3)
    assert after["radixlm:prefix_cache_hits_total"] - before.get("radixlm:prefix_cache_hits_total", 0) >= 64
    assert after["radixlm:prompt_tokens_total"] > before["radixlm:prompt_tokens_total"]
    assert 0 <= after["radixlm:kv_cache_usage"] <= 1


# ---------------------------------------------------------------------- load and disconnects
async def _stream_one(client: httpx.AsyncClient, server: ServerProcess, i: int) -> str:
    body = {"text": f"item_{i} =", "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    async with client.stream("POST", server.url("/generate"), json=body) as r:
        assert r.status_code == 200
        lines = [ln async for ln in r.aiter_lines()]
    return sse_events(lines)[-1]["meta_info"]["finish_reason"]["type"]


def test_200_concurrent_streams_complete(server: ServerProcess) -> None:
    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
        async with httpx.AsyncClient(limits=limits, timeout=180) as client:
            return await asyncio.gather(*(_stream_one(client, server, i) for i in range(200)))

    reasons = asyncio.run(run())
    assert len(reasons) == 200 and set(reasons) <= {"stop", "length"}
    wait_kv_free(server)


def test_disconnects_free_kv_and_count_aborts(server: ServerProcess) -> None:
    before = metric_values(server).get("radixlm:num_aborted_requests_total", 0.0)

    async def disconnect(client: httpx.AsyncClient, i: int) -> None:
        body = {"text": f"row{i} = [", "stream": True,
                "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
        async with client.stream("POST", server.url("/generate"), json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    break   # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            await asyncio.gather(*(disconnect(client, i) for i in range(20)))

    asyncio.run(run())
    state = wait_kv_free(server, timeout=20)
    assert state["num_running_reqs"] == 0
    deadline = time.monotonic() + 10
    while metric_values(server).get("radixlm:num_aborted_requests_total", 0.0) - before < 20:
        assert time.monotonic() < deadline, "aborted requests were not counted"
        time.sleep(0.2)
    assert httpx.get(server.url("/health_generate"), timeout=60).status_code == 200


# ---------------------------------------------------------------------- child death
def test_child_death_fails_requests_and_exits(llama_path: str) -> None:
    srv = start_server(llama_path, *SERVER_FLAGS)
    try:
        children = [p for p in child_pids(srv.proc.pid) if pid_alive(p) and _is_worker(p)]
        assert children, "the server has no child processes"
        body = {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}}
        with httpx.stream("POST", srv.url("/generate"), json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(children[0], signal.SIGKILL)
            killed_at = time.monotonic()
            events = [ln for ln in lines if ln.startswith("data: ")]
        assert any('"error"' in ln for ln in events), events[-2:]
        srv.proc.wait(timeout=10)
        assert time.monotonic() - killed_at < 5.0 + 0.5
        assert srv.proc.returncode != 0
        time.sleep(0.5)
        assert not [p for p in children if pid_alive(p)], "orphaned child processes"
    finally:
        srv.stop()


def _is_worker(pid: int) -> bool:
    """A scheduler/detokenizer child (started as `python -m radixlm.runtime.entrypoints.child`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"radixlm.runtime.entrypoints.child" in cmdline
