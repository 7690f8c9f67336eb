"""Soak: hundreds (CI) or thousands (`--runslow`) of mixed requests against one real server whose
KV pool is small (1500 tokens), so that the radix cache evicts and the scheduler preempts.

The mix, drawn from a seeded RNG: greedy requests whose solo output is known (32%), sampled ones
(15%), n > 1 (8%), regex-constrained ones (7%), OpenAI chat (10%), batches (5%), requests with a
short `timeout` (3%), client disconnects (10%: mid-stream, or a plain request given up on),
explicit aborts through /abort_request (5%) and invalid requests (5%); about half stream. The run has two halves with an idle point in between.

Afterwards:
  * every valid request that was neither aborted nor cut off completed (stop/length), and every
    greedy one produced exactly the text and ids of a solo run of the same prompt, computed on
    the same server before the soak, one request at a time;
  * every invalid request got a 4xx;
  * at idle, free + evictable == total KV tokens and every req row is free;
  * the scheduler preempted (retracted) requests at least once;
  * the RSS of the server's processes grew by less than 5% over the second half.
The figures (requests, status histogram, preemptions, RSS) are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server_fixtures import (
    ServerProcess,
    kv_state,
    metric_values,
    server_fixture,
    wait_kv_free,
)

SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "512", "--max-total-tokens", "1500",
                "--schedule-conservativeness", "0.3")
# one torch thread in the scheduler: on a shared 2-core machine two spinning OpenMP threads make a
# tiny model's decode step up to 100x slower (MACHINE_FACTS.md, Noise)
ONE_THREAD = {"RADIXLM_NUM_THREADS": "1"}
CI_REQUESTS = 500
SLOW_REQUESTS = 5000
CONCURRENCY = 48
NUM_REFS = 12
REGEX = r"(yes|no): [0-9]{1,3}"
WORDS = ("def", "return", "self", "import", "class", "value", "for", "in", "range", "print", "if", "else",
         "list", "dict", "x", "y", "=", "(", ")", ":", "+", "1", "2", "None", "True", "data", "item")
KINDS = (("greedy", 32), ("sample", 15), ("n", 8), ("regex", 7), ("chat", 10), ("batch", 5), ("timeout", 3),
         ("disconnect", 10), ("abort", 5), ("invalid", 5))
INVALID_BODIES: list[tuple[str, Any]] = [
    ("/generate", {"text": ""}),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}),
    ("/generate", {"input_ids": [5, 10**6]}),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 5000}}),
    ("/generate", {"text": "a", "sampling_params": {"regex": "(unclosed"}}),
    ("/generate", b'{"text": "a", '),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/completions", {"model": "m", "prompt": "a", "max_tokens": -3}),
]


@dataclass
class Result:
    kind: str
    status: int | str                       # HTTP status, or "disconnected"
    problems: list[str] = field(default_factory=list)


@dataclass
class Refs:
    prompts: list[str]
    new_tokens: list[int]
    texts: list[str]
    ids: list[list[int]]


# ---------------------------------------------------------------------- setup
server = server_fixture(*SERVER_FLAGS, env=ONE_THREAD, clean_exit=True)


def random_text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def solo_references(server: ServerProcess) -> Refs:
    """Greedy outputs of NUM_REFS prompts (half share a header), one request at a time."""
    rng = random.Random(1234)
    header = random_text(rng, 30, 30)
    prompts = [(header + " " if i % 2 else "") + random_text(rng, 4, 60) for i in range(NUM_REFS)]
    new_tokens = [rng.randint(8, 96) for _ in range(NUM_REFS)]
    texts, ids = [], []
    for prompt, n in zip(prompts, new_tokens, strict=True):
        r = httpx.post(server.url("/generate"), json=_greedy_body(prompt, n), timeout=120)
        r.raise_for_status()
        out = r.json()
        assert out["meta_info"]["completion_tokens"] == n
        texts.append(out["text"])
        ids.append(out["output_ids"])
    return Refs(prompts, new_tokens, texts, ids)


def _greedy_body(prompt: str, n: int) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


def server_rss(server: ServerProcess) -> int:
    """Resident memory (bytes) of the server process and all its descendants."""
    from tests.server_fixtures import descendant_pids

    total = 0
    for pid in [server.proc.pid, *descendant_pids(server.proc.pid)]:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


# ---------------------------------------------------------------------- one request
class Soak:
    def __init__(self, server: ServerProcess, refs: Refs, seed: int):
        self.server = server
        self.refs = refs
        self.seed = seed
        self.rng = random.Random(seed)
        self.results: list[Result] = []

    def plan(self, n: int) -> list[tuple[int, str]]:
        kinds, weights = zip(*KINDS, strict=True)
        return [(i, self.rng.choices(kinds, weights)[0]) for i in range(n)]

    async def run(self, plan: list[tuple[int, str]]) -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
        sem = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as client:
            async def one(i: int, kind: str) -> None:
                async with sem:
                    rng = random.Random(f"{self.seed}-{i}-{kind}")
                    self.results.append(await getattr(self, f"_{kind}")(client, rng, i))

            await asyncio.gather(*(one(i, kind) for i, kind in plan))

    # -- helpers
    async def _post(self, client: httpx.AsyncClient, path: str, body: Any, stream: bool) -> tuple[int, Any]:
        """(status, parsed result); a stream's result is its list of data events."""
        if not stream:
            r = await client.post(self.server.url(path), json=body)
            return r.status_code, r.json()
        async with client.stream("POST", self.server.url(path), json={**body, "stream": True}) as r:
            text = "".join([chunk async for chunk in r.aiter_text()])
        if r.status_code != 200:
            return r.status_code, json.loads(text)
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return -1, events                                    # -1: the stream did not end properly
        parsed = [json.loads(e) for e in events[:-1]]
        if any("error" in ev for ev in parsed):
            return -2, parsed                                    # -2: an error event inside a 200 stream
        return r.status_code, parsed

    @staticmethod
    def _check_finished(result: Result, meta: dict, max_tokens: int) -> None:
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length"):
            result.problems.append(f"finish_reason {meta.get('finish_reason')}")
        if meta.get("completion_tokens", 0) > max_tokens:
            result.problems.append(f"{meta['completion_tokens']} tokens > {max_tokens}")

    # -- kinds
    async def _greedy(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        k = rng.randrange(NUM_REFS)
        stream = rng.random() < 0.5
        status, out = await self._post(client, "/generate", _greedy_body(self.refs.prompts[k],
                                                                           self.refs.new_tokens[k]), stream)
        res = Result("greedy", status)
        if status == 200:
            final = out[-1] if stream else out
            if final["text"] != self.refs.texts[k] or final["output_ids"] != self.refs.ids[k]:
                res.problems.append(f"greedy output differs from the solo run for prompt {k}: "
                                    f"{final['text']!r} != {self.refs.texts[k]!r}")
        else:
            res.problems.append(f"status {status}: {str(out)[:200]}")
        return res

    async def _sample(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        n = rng.randint(1, 120)
        body = {"text": random_text(rng, 2, 80), "sampling_params": {"max_new_tokens": n, "temperature": 0.8}}
        return self._single("sample", *await self._post(client, "/generate", body, rng.random() < 0.5), n)

    async def _regex(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        body = {"text": random_text(rng, 2, 40), "sampling_params": {"max_new_tokens": 64, "regex": REGEX}}
        stream = rng.random() < 0.5
        status, out = await self._post(client, "/generate", body, stream)
        res = self._single("regex", status, out, 64)
        final = (out[-1] if stream else out) if status == 200 else None
        if final is not None and not re.fullmatch(REGEX, final["text"]):
            res.problems.append(f"regex output {final['text']!r} does not match")
        return res

    def _single(self, kind: str, status: int, out: Any, max_tokens: int) -> Result:
        res = Result(kind, status)
        if status != 200:
            res.problems.append(f"status {status}: {str(out)[:200]}")
        else:
            self._check_finished(res, (out[-1] if isinstance(out, list) else out)["meta_info"], max_tokens)
        return res

    async def _n(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        n, max_new = rng.randint(2, 3), rng.randint(1, 60)
        body = {"text": random_text(rng, 2, 60), "sampling_params": {"max_new_tokens": max_new, "n": n,
                                                                      "temperature": 0.7}}
        stream = rng.random() < 0.5
        status, out = await self._post(client, "/generate", body, stream)
        if stream and status == 200:   # the last chunk of each sample
            out = list({ev["index"]: ev for ev in out}.values())
        return self._many("n", status, out, n, max_new)

    async def _batch(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        size, max_new = rng.randint(2, 4), rng.randint(1, 40)
        body = {"text": [random_text(rng, 2, 40) for _ in range(size)],
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.5}}
        return self._many("batch", *await self._post(client, "/generate", body, False), size, max_new)

    def _many(self, kind: str, status: int, out: Any, count: int, max_tokens: int) -> Result:
        res = Result(kind, status)
        if status != 200 or not isinstance(out, list) or len(out) != count:
            res.problems.append(f"status {status}, expected {count} items: {str(out)[:200]}")
            return res
        for item in out:
            self._check_finished(res, item["meta_info"], max_tokens)
        return res

    async def _chat(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        max_tokens = rng.randint(1, 80)
        body = {"model": "m", "max_tokens": max_tokens, "temperature": rng.choice([0, 0.7]),
                "messages": [{"role": "user", "content": random_text(rng, 2, 50)}]}
        stream = rng.random() < 0.5
        status, out = await self._post(client, "/v1/chat/completions", body, stream)
        res = Result("chat", status)
        if status != 200:
            res.problems.append(f"status {status}: {str(out)[:200]}")
            return res
        finishes = [c["finish_reason"] for ev in (out if stream else [out]) for c in ev.get("choices", [])
                    if c.get("finish_reason")]
        if finishes != ["stop"] and finishes != ["length"]:
            res.problems.append(f"chat finish reasons {finishes}")
        return res

    async def _disconnect(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        body = {"text": random_text(rng, 2, 60), "stream": True,
                "sampling_params": {"max_new_tokens": rng.randint(40, 200), "ignore_eos": True}}
        if rng.random() < 0.3:         # not streaming: the client gives up waiting
            try:
                await asyncio.wait_for(client.post(self.server.url("/generate"), json={**body, "stream": False}),
                                       rng.uniform(0.01, 0.2))
            except asyncio.TimeoutError:
                pass
            return Result("disconnect", "disconnected")
        keep = rng.randint(1, 3)
        async with client.stream("POST", self.server.url("/generate"), json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= keep:
                    break      # leaving the block closes the connection mid-stream
        return Result("disconnect", "disconnected")

    async def _timeout(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        params: dict[str, Any] = {"max_new_tokens": rng.randint(100, 400), "ignore_eos": True}
        if rng.random() < 0.3:
            params = {"max_new_tokens": 64, "regex": f"[a-z]{{{rng.randint(1, 5)}}}( [0-9]+)*"}
        body = {"text": random_text(rng, 2, 60), "timeout": rng.uniform(0.0, 0.3), "sampling_params": params}
        status, out = await self._post(client, "/generate", body, rng.random() < 0.5)
        res = Result("timeout", status)
        reason = ((out[-1] if isinstance(out, list) else out).get("meta_info") or {}).get("finish_reason") \
            if status == 200 and out else None
        if not reason or reason["type"] not in ("length", "stop") and reason != {"type": "abort", "message": "timeout"}:
            res.problems.append(f"timed request: status {status}, finish_reason {reason}")
        return res

    async def _abort(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        rid = f"soak-abort-{i}-{rng.randrange(10**9)}"
        body = {"text": random_text(rng, 2, 60), "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": rng.randint(100, 300), "ignore_eos": True}}
        last: dict = {}
        async with client.stream("POST", self.server.url("/generate"), json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    if not last:
                        await client.post(self.server.url("/abort_request"), json={"rid": rid})
                    last = json.loads(line[6:])
        reason = (last.get("meta_info") or {}).get("finish_reason") or {}
        res = Result("abort" if reason.get("type") == "abort" else "abort-too-late", r.status_code)
        if reason.get("type") not in ("abort", "length"):   # length: it finished before the abort landed
            res.problems.append(f"aborted request ended with {reason}")
        return res

    async def _invalid(self, client: httpx.AsyncClient, rng: random.Random, i: int) -> Result:
        path, body = rng.choice(INVALID_BODIES)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await client.post(self.server.url(path), content=content, headers={"Content-Type": "application/json"})
        res = Result("invalid", r.status_code)
        if not 400 <= r.status_code < 500:
            res.problems.append(f"invalid request to {path} got {r.status_code}: {r.text[:200]}")
        return res


# ---------------------------------------------------------------------- the test
def _run_soak(server: ServerProcess, total: int) -> None:
    started = time.monotonic()
    refs = solo_references(server)
    soak = Soak(server, refs, seed=total)
    plan = soak.plan(total)
    half = total // 2
    asyncio.run(soak.run(plan[:half]))
    wait_kv_free(server, timeout=30)
    rss_mid = server_rss(server)
    asyncio.run(soak.run(plan[half:]))
    state = wait_kv_free(server, timeout=30)
    rss_end = server_rss(server)
    elapsed = time.monotonic() - started
    preemptions = state["num_preemptions"]
    metric = metric_values(server).get("radixlm:num_preemptions_total")
    statuses = Counter(str(r.status) for r in soak.results)
    kinds = Counter(r.kind for r in soak.results)
    print(f"\nsoak: {len(soak.results)} requests in {elapsed:.1f} s; kinds {dict(kinds)}\n"
          f"status codes {dict(sorted(statuses.items()))}\npreemptions {preemptions} (metric {metric}); "
          f"KV {state['kv_free_tokens']} free + {state['kv_evictable_tokens']} evictable of "
          f"{state['kv_total_tokens']}\nRSS {rss_mid / 2**20:.1f} MiB after the first half, "
          f"{rss_end / 2**20:.1f} MiB at the end ({(rss_end / rss_mid - 1) * 100:+.2f}%)")
    problems = [f"{r.kind}: {p}" for r in soak.results for p in r.problems]
    assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(problems[:10])
    assert len(soak.results) == total
    assert state["kv_free_tokens"] + state["kv_evictable_tokens"] == state["kv_total_tokens"]
    assert state["req_rows_free"] == state["req_rows_total"]
    assert preemptions > 0, "the soak never preempted a request: the KV pool is too large for the load"
    assert rss_end < rss_mid * 1.05, f"RSS grew from {rss_mid} to {rss_end} bytes over the second half"
    assert kv_state(server)["num_running_reqs"] == 0


def test_soak_ci(server: ServerProcess) -> None:
    _run_soak(server, CI_REQUESTS)


@pytest.mark.slow
def test_soak_long(server: ServerProcess) -> None:
    _run_soak(server, SLOW_REQUESTS)
