"""Side by side: bench_serving.py against two servers in one invocation (`--compare-base-url`).

Both servers get the same client, the same prompts (made once, with the first server's tokenizer)
and the same load, back to back: for each concurrency and each repeat both run, the first server
first on even repeats and the second first on odd ones. Before each run the benchmark waits (up to
15 s) until the machine is quiet (`quiet_wait_s` in the JSON): a server may keep a core busy after
its last response (vLLM's CPU engine for 1-1.3 s), and the run that followed it paid for that.
First, both complete the same few prompts greedily and the JSON records whether they agree
(`greedy_agreement`). Each run records how busy the machine was while it ran, since both servers
(and anything else) share the cores. The table has one row per (concurrency, repeat) with both systems'
output tok/s, TPOT p50 and TTFT p50 and the ratios, each written so that > 1 means the first server
is better: output tok/s first/second, TPOT and TTFT second/first.

`--compare-launch CMD` starts the second server itself (a shell command, e.g. `vllm serve ...`)
and stops it at the end; it must serve at `--compare-base-url`.

Prefix caches: before each run the first server's cache is flushed (`/flush_cache` for radixlm
backends), and for an OpenAI peer `POST /reset_prefix_cache` is tried (vLLM serves it when started
with `VLLM_SERVER_DEV_MODE=1`), then llama.cpp's per-slot erase (`POST /slots/{id}?action=erase`,
which llama-server refuses with a 501 unless started with `--slot-save-path DIR`; start it with
`--cache-ram 0` too, or its host-memory prompt cache survives). Whether
the peer's flush worked is in the JSON (`peer_cache_reset`); without it, later runs (same prompts,
same seed) hit the peer's cache: an earlier llama.cpp comparison did, and its TTFT was not cold.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import common
import httpx

PEER_READY_TIMEOUT = 900.0
AGREE_PROMPTS = 4       # prompts both servers complete greedily before the timed runs
AGREE_TOKENS = 24


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("side by side (one invocation, two servers)")
    g.add_argument("--compare-base-url", help="a second server to run the same benchmark against, back to back")
    g.add_argument("--compare-backend", choices=("radixlm", "radixlm-openai", "openai"), default="openai",
                   help="API of the second server (default: %(default)s)")
    g.add_argument("--compare-name", default="peer", help="the second server's name in the table (default: %(default)s)")
    g.add_argument("--name", default="radixlm", help="the first server's name in the table (default: %(default)s)")
    g.add_argument("--compare-model", help="model name for the second server's OpenAI requests (default: its first)")
    g.add_argument("--compare-launch", help="shell command that starts the second server (stopped at the end)")
    g.add_argument("--repeats", type=int, default=1, help="runs of each concurrency per server (default: %(default)s)")
    g.add_argument("--quiet-wait", type=float, default=15.0, metavar="S",
                   help="before each run, wait up to S seconds for the machine to be under 10%% busy "
                        "(the other server's tail; default: %(default)s)")


class PeerProcess:
    """The second server started from `--compare-launch`, in its own process group."""

    def __init__(self, command: str, base_url: str, timeout: float = PEER_READY_TIMEOUT):
        self.log_path = tempfile.mkstemp(prefix="bench-peer-", suffix=".log")[1]
        self._log = open(self.log_path, "w")
        print(f"launching peer: {command}  (log: {self.log_path})")
        self.proc = subprocess.Popen(command, shell=True, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"peer exited with code {self.proc.returncode}; log: {self.log_path}")
            try:
                if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"peer not ready within {timeout:.0f} s; log: {self.log_path}")

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM to the peer's whole process group, then SIGKILL after `grace` seconds."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


class Target:
    """One server under test: its name, HTTP client, benchmark client and cache flush."""

    def __init__(self, name: str, args: argparse.Namespace, http: httpx.AsyncClient, client: Any):
        self.name, self.args, self.http, self.client = name, args, http, client

    async def flush(self) -> bool | None:
        """Empties the server's prefix cache; True/False: worked or not, None: not asked for."""
        if not self.args.flush_cache:
            return None
        if self.args.backend != "openai":
            return await self._post("/flush_cache")
        return await self._post("/reset_prefix_cache") or await self._erase_slots()

    async def _post(self, path: str) -> bool:
        try:
            resp = await self.http.post(path, headers=self.args.headers)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def _erase_slots(self) -> bool:
        """llama.cpp's server: `GET /slots`, then `POST /slots/{id}?action=erase` for each slot."""
        try:
            resp = await self.http.get("/slots", headers=self.args.headers)
            slots = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return False
        if not isinstance(slots, list) or not slots:
            return False
        return all([await self._post(f"/slots/{s['id']}?action=erase") for s in slots if "id" in s])


def peer_args(args: argparse.Namespace) -> argparse.Namespace:
    """The first server's settings with the second server's API, model name and URL."""
    peer = copy.copy(args)
    peer.backend = args.compare_backend
    peer.model = args.compare_model
    peer.base_url = args.compare_base_url.rstrip("/")
    return peer


async def bench_compare(bs: Any, args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    """`bs` is the bench_serving module. Runs every (concurrency, repeat) on both servers."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    p_args = peer_args(args)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http_a, \
            httpx.AsyncClient(base_url=p_args.base_url, timeout=timeout, limits=limits) as http_b:
        model_a, tokenizer, args.context_len = await bs.discover(args, http_a)
        model_b, _, context_b = await bs.discover(_without_tokenizer(p_args), http_b)
        p_args.context_len = args.context_len or context_b
        maker = bs.PromptMaker(tokenizer, args.seed)
        targets = [Target(args.name, args, http_a, bs.Client(args, http_a, maker, model_a)),
                   Target(args.compare_name, p_args, http_b, bs.Client(p_args, http_b, maker, model_b))]
        for t in targets:
            for _ in range(args.warmup_requests):
                await t.client.send([{"role": "user", "content": maker.text(8)}], 4, raw=True)
        agreement = await greedy_agreement(targets, [model_a, model_b], [maker.text(48) for _ in range(AGREE_PROMPTS)])
        runs = []
        for concurrency in args.max_concurrency or [None]:
            for repeat in range(args.repeats):
                for t in (targets if repeat % 2 == 0 else targets[::-1]):
                    runs.append(await _one_run(bs, t, tokenizer, concurrency, repeat))
    return {"base_url": base_url, "compare_base_url": p_args.base_url, "names": [args.name, args.compare_name],
            "models": [model_a, model_b], "tokenizer": getattr(tokenizer, "name_or_path", None),
            "greedy_agreement": agreement, "runs": runs}


async def greedy_agreement(targets: list[Target], models: list[str], prompts: list[str]) -> list[dict[str, Any]]:
    """Both servers' greedy completions (AGREE_TOKENS tokens, OpenAI /v1/completions) of the same
    prompts: speed bought with wrong output shows here. Recorded and printed, not asserted (two
    correct implementations can still part at a near-tie, more so in bf16 or quantized)."""
    out = []
    for prompt in prompts:
        texts = []
        for t, model in zip(targets, models):
            try:
                resp = await t.http.post("/v1/completions", headers=t.args.headers, json={
                    "model": model, "prompt": prompt, "max_tokens": AGREE_TOKENS, "temperature": 0})
                texts.append(resp.json()["choices"][0]["text"] if resp.status_code == 200 else None)
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                texts.append(None)
        a, b = texts
        common_chars = len(os.path.commonprefix([a, b])) if a is not None and b is not None else None
        out.append({"same": a is not None and a == b, "common_prefix_chars": common_chars,
                    "chars": [None if x is None else len(x) for x in texts], "texts": texts})
    same = sum(r["same"] for r in out)
    print(f"greedy agreement ({AGREE_TOKENS} tokens): {same}/{len(out)} prompts identical; common prefix "
          f"chars {[r['common_prefix_chars'] for r in out]} of {[r['chars'] for r in out]}")
    return out


def _without_tokenizer(args: argparse.Namespace) -> argparse.Namespace:
    """The peer reuses the first server's prompts, so it need not load a tokenizer."""
    out = copy.copy(args)
    out.tokenizer = None
    return out


async def _one_run(bs: Any, t: Target, tokenizer: Any, concurrency: int | None, repeat: int) -> dict[str, Any]:
    flushed = await t.flush()
    if flushed is False:
        print(f"WARNING: could not reset {t.name}'s prefix cache: its later runs see the same prompts warm "
              f"(vLLM: start it with VLLM_SERVER_DEV_MODE=1)", file=sys.stderr)
    dataset = bs.make_dataset(t.args, bs.PromptMaker(tokenizer, t.args.seed), concurrency)
    quiet_wait = await asyncio.to_thread(common.wait_for_quiet, t.args.quiet_wait)   # the other server's tail
    before = await bs.cache_counters(t.http)
    with common.LoadMonitor() as load:
        results, duration, skipped = await bs.run_once(t.args, t.client, dataset, concurrency)
    after = await bs.settled_counters(t.http) if before is not None else None
    run = bs.summarize_run(results, duration, concurrency, t.args.request_rate, bs.hit_rate(before, after))
    return {**run, "system": t.name, "repeat": repeat, "cache_reset": flushed, "turns_skipped_context": skipped,
            "machine_busy_fraction": load.summary()["busy_fraction"], "quiet_wait_s": round(quiet_wait, 2)}


def compare_rows(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Pairs each run of the first server with the second's run of the same concurrency and repeat."""
    first, second = names
    by_key = {(r["max_concurrency"], r["repeat"], r["system"]): r for r in runs}
    rows = []
    for r in runs:
        if r["system"] != first:
            continue
        peer = by_key.get((r["max_concurrency"], r["repeat"], second))
        if peer is None:
            continue
        rows.append({"max_concurrency": r["max_concurrency"], "repeat": r["repeat"], "a": r, "b": peer,
                     "output_throughput_ratio": _ratio(r["output_throughput"], peer["output_throughput"]),
                     "tpot_p50_ratio": _ratio(peer["tpot_ms"]["p50"], r["tpot_ms"]["p50"]),
                     "ttft_p50_ratio": _ratio(peer["ttft_ms"]["p50"], r["ttft_ms"]["p50"])})
    return rows


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def compare_table(results: dict[str, Any]) -> str:
    a, b = results["names"]
    rows = compare_rows(results["runs"], results["names"])
    headers = ["concurrency", "run", f"{a} out tok/s", f"{b} out tok/s", f"out tok/s {a}/{b}",
               f"TPOT p50 ms {a} / {b}", f"TPOT {b}/{a}", f"TTFT p50 ms {a} / {b}", f"TTFT {b}/{a}",
               "done/failed", "busy cores during runs", "cache hit"]

    def pair(key: str, x: dict[str, Any], y: dict[str, Any]) -> str:
        return f"{common.fmt(x[key]['p50'], 1)} / {common.fmt(y[key]['p50'], 1)}"

    def hit(run: dict[str, Any]) -> str:
        rate = run["cache_hit_rate"]
        return "-" if rate is None else f"{rate:.1%}"

    body = [[r["max_concurrency"] or "inf", r["repeat"] + 1, r["a"]["output_throughput"],
             r["b"]["output_throughput"], _x(r["output_throughput_ratio"]), pair("tpot_ms", r["a"], r["b"]),
             _x(r["tpot_p50_ratio"]), pair("ttft_ms", r["a"], r["b"]), _x(r["ttft_p50_ratio"]),
             f"{r['a']['completed']}/{r['a']['failed']} , {r['b']['completed']}/{r['b']['failed']}",
             f"{r['a']['machine_busy_fraction']:.0%} / {r['b']['machine_busy_fraction']:.0%}",
             f"{hit(r['a'])} / {hit(r['b'])}"]
            for r in rows]
    note = (f"\n\nRatios: > 1 means {a} is better (throughput {a}/{b}; TPOT and TTFT {b}/{a}). "
            f"Busy cores: share of all cores in use during each run (both servers and anything else).")
    agree = results.get("greedy_agreement")
    if agree:
        note += (f"\n\nGreedy agreement before the runs ({AGREE_TOKENS} tokens, temperature 0): "
                 f"{sum(r['same'] for r in agree)}/{len(agree)} prompts gave the same text on both; common "
                 f"prefix {[r['common_prefix_chars'] for r in agree]} of {[r['chars'] for r in agree]} characters.")
    warm = sorted({r["system"] for r in results["runs"] if r.get("cache_reset") is False})
    if warm:
        note += (f"\n\n**Not a cold comparison**: the prefix cache of {', '.join(warm)} could not be reset before "
                 f"its runs (vLLM: start it with VLLM_SERVER_DEV_MODE=1), so runs after the first (same prompts) "
                 f"hit its cache.")
    errors = sorted({e for r in results["runs"] for e in r["errors"]})
    if errors:
        note += "\n\nErrors: " + "; ".join(errors[:5])
    return common.markdown_table(headers, body) + note


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def run(bs: Any, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Starts the peer if asked, then runs `bench_compare` through common.run_against_server."""
    peer = PeerProcess(args.compare_launch, args.compare_base_url.rstrip("/")) if args.compare_launch else None
    try:
        results, load = common.run_against_server(args, lambda a, url: bench_compare(bs, a, url))
    finally:
        if peer:
            peer.stop()
    results["compare_launch"] = shlex.split(args.compare_launch) if args.compare_launch else None
    results["rows"] = compare_rows(results["runs"], results["names"])
    return results, load
