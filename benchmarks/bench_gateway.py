"""SGLang's Model Gateway (`sglang-router`) in front of two radixlm workers, against one worker alone.

The shared-prefix workload of bench_serving (`--gsp-groups` groups of `--gsp-prompts-per-group`
requests, each group sharing a `--gsp-system-len`-token prefix) runs three ways, back to back,
with the same client and prompts:

    gateway, --policy cache_aware   in front of workers A and B
    gateway, --policy round_robin   in front of workers A and B
    worker A alone                  (direct, no gateway)

Each worker is pinned to its own `--cores-per-worker` cores (sched_setaffinity before it starts;
its children inherit it) and runs that many torch threads, so "two workers" is what a second
machine adds: on a 2-core box, one core each, and the single worker has one core too. Before each
run both workers' radix caches are flushed; the aggregate cache hit is read from both workers'
/metrics counters (the gateway's own /metrics has none), so it is the fraction of prompt tokens
that hit, over the whole fleet.

    python benchmarks/bench_gateway.py --model-path smollm2-135m-instruct \
        [--gsp-groups 8 --gsp-prompts-per-group 16 --max-concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_serving  # noqa: E402
import common  # noqa: E402
import httpx  # noqa: E402

from radixlm.testing.gateway import launch_gateway  # noqa: E402
from radixlm.testing.server import launch_server_process  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m-instruct")
    p.add_argument("--server-args", default="", help="extra flags for both workers")
    p.add_argument("--cores-per-worker", type=int, default=1)
    p.add_argument("--gsp-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-len", type=int, default=1024)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 64], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 32], metavar=("MIN", "MAX"))
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--output-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--result-name", default="bench_gateway")
    return p.parse_args(argv)


def start_worker(args: argparse.Namespace, cores: set[int]) -> Any:
    """A worker pinned to `cores`: this process takes the affinity for the launch, its child keeps it."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        flags = ["--model-path", args.model_path, *shlex.split(args.server_args)]
        return launch_server_process(None, *flags, timeout=600, ready="health", log_prefix="radixlm-bench-worker",
                                     env={"RADIXLM_NUM_THREADS": str(len(cores))})
    finally:
        os.sched_setaffinity(0, saved)


def fleet_counters(workers: list[Any]) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens) summed over the workers' /metrics."""
    hits = queries = 0.0
    for w in workers:
        text = httpx.get(w.url("/metrics"), timeout=10).text
        hits += bench_serving.parse_metric(text, "radixlm:prefix_cache_hits_total") or 0.0
        queries += bench_serving.parse_metric(text, "radixlm:prefix_cache_queries_total") or 0.0
    return hits, queries


def one_run(args: argparse.Namespace, url: str, workers: list[Any]) -> dict[str, Any]:
    for w in workers:
        httpx.post(w.url("/flush_cache"), timeout=30).raise_for_status()
    bench_args = bench_serving.parse_args([
        "--backend", "radixlm", "--base-url", url, "--tokenizer", workers[0].tokenizer_path,
        "--dataset", "generated-shared-prefix", "--gsp-groups", str(args.gsp_groups),
        "--gsp-prompts-per-group", str(args.gsp_prompts_per_group), "--gsp-system-len", str(args.gsp_system_len),
        "--input-len", *map(str, args.input_len), "--output-len", *map(str, args.output_len), "--ignore-eos",
        "--max-concurrency", str(args.max_concurrency), "--no-flush-cache", "--seed", str(args.seed), "--quiet"])
    before = fleet_counters(workers)
    run = asyncio.run(bench_serving.bench(bench_args, url))["runs"][0]
    after = asyncio.run(_settled(workers, before))
    run["cache_hit_rate"] = bench_serving.hit_rate(before, after)
    return run


async def _settled(workers: list[Any], before: tuple[float, float]) -> tuple[float, float]:
    """The fleet's counters once every worker pushed its final ones (see bench_serving.settled_counters)."""
    for w in workers:
        async with httpx.AsyncClient(base_url=w.base_url) as http:
            await bench_serving.settled_counters(http)
    return fleet_counters(workers)


def table_of(rows: list[dict[str, Any]]) -> str:
    single = next(r for r in rows if r["setup"] == "one worker")["output_throughput"]
    lines = ["| setup | out tok/s | x one worker | TTFT p50 ms | TPOT p50 ms | fleet cache hit | done/failed |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        hit = "-" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.1f}%"
        lines.append(f"| {r['setup']} | {r['output_throughput']:.1f} | {r['output_throughput'] / single:.2f} | "
                     f"{r['ttft_ms']['p50']:.0f} | {r['tpot_ms']['p50']:.1f} | {hit} | "
                     f"{r['completed']}/{r['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    k = args.cores_per_worker
    if len(cores) < 2 * k:
        raise SystemExit(f"needs {2 * k} cores for two workers of {k}; this process may use {len(cores)}")
    workers = [start_worker(args, set(cores[:k])), start_worker(args, set(cores[k:2 * k]))]
    for w in workers:
        w.tokenizer_path = httpx.get(w.url("/get_model_info"), timeout=10).json().get("tokenizer_path")
    rows = []
    try:
        with common.LoadMonitor() as load:
            for policy in ("cache_aware", "round_robin"):
                with launch_gateway([w.base_url for w in workers], policy=policy) as gw:
                    rows.append({"setup": f"gateway {policy}, 2 workers", **one_run(args, gw.base_url, workers)})
            rows.append({"setup": "one worker", **one_run(args, workers[0].base_url, workers[:1])})
    finally:
        for w in workers:
            w.stop()
    results = {"rows": rows, "workload": vars(args), "worker_command": shlex.join(workers[0].command)}
    common.write_results(args.result_name, args.output_dir, results, table_of(rows), load.summary())
    return results


if __name__ == "__main__":
    main()
