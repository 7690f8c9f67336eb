"""DSL benchmark: a multi-turn chat workload and a fork-heavy workload, run through `@function`
programs against a radixlm server with the radix cache on and then off (`--disable-radix-cache`).

It starts each server itself (radixlm.Runtime), and reports, per workload and cache mode:
throughput (programs/s, generated tokens/s), the cache hit rate seen by the programs
(sum of meta_info cached_tokens / prompt_tokens) and by the server (/metrics prefix-cache
counters), plus the machine's CPU load during the run (the machine may be shared).
Output: JSON (stdout or --output) and a Markdown table (stderr, or --markdown FILE).

    python benchmarks/bench_dsl.py --model-path /path/to/model --num-programs 32 --turns 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

import radixlm.api as sgl

SYSTEM_SENTENCE = "You are a concise assistant for Python developers; cite the relevant module. "
DOC_SENTENCE = "The pathlib module offers classes representing filesystem paths with semantics for many OSes. "


# -------------------------------------------------------------------- workloads
def make_multi_turn(system_prompt: str, turns: int, max_tokens: int) -> Any:
    @sgl.function
    def multi_turn(s, questions):
        s += sgl.system(system_prompt)
        for i, question in enumerate(questions[:turns]):
            s += sgl.user(question)
            s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=max_tokens, ignore_eos=True))

    return multi_turn


def make_fork_heavy(width: int, max_tokens: int) -> Any:
    @sgl.function
    def fork_heavy(s, document, topic):
        s += "Document:\n" + document + "\nTopic: " + topic + "\n"
        branches = s.fork(width)
        for i, branch in enumerate(branches):
            branch += f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=max_tokens, ignore_eos=True)
        branches.join()
        s += "Summary of the ideas:" + sgl.gen("summary", max_tokens=max_tokens, ignore_eos=True)

    return fork_heavy


def multi_turn_batch(n: int, turns: int) -> list[dict[str, Any]]:
    return [{"questions": [f"Question {t + 1} from user {i}: which module handles task {i * turns + t}?"
                           for t in range(turns)]} for i in range(n)]


def fork_batch(n: int, doc_sentences: int) -> list[dict[str, Any]]:
    return [{"document": f"[doc {i}] " + DOC_SENTENCE * doc_sentences, "topic": f"topic {i}"} for i in range(n)]


# -------------------------------------------------------------------- measuring
def walk_meta(state: Any) -> list[dict[str, Any]]:
    """Every gen meta-info dict of a state and of its forks."""
    out, todo = [], [state.stream_executor]
    while todo:
        executor = todo.pop()
        out += [m for m in executor.meta_info.values() if isinstance(m, dict) and "prompt_tokens" in m]
        todo += executor.children
    return out


def server_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("prefix_cache_queries", "prefix_cache_hits"):
            if line.startswith(f"radixlm:{name}_total"):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies from /proc/stat (0, 0 where unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def run_once(program: Any, batch: list[dict[str, Any]], runtime: sgl.Runtime) -> dict[str, Any]:
    runtime.flush_cache()
    time.sleep(1.0)  # let the scheduler push its stats so the counters below start settled
    before, cpu0, start = server_counters(runtime.url), cpu_times(), time.perf_counter()
    states = program.run_batch(batch, temperature=0, backend=runtime)
    elapsed = time.perf_counter() - start
    cpu1 = cpu_times()
    errors = [str(s.error()) for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} program(s) failed, first: {errors[0]}")
    time.sleep(1.0)
    after = server_counters(runtime.url)
    metas = [m for s in states for m in walk_meta(s)]
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m.get("cached_tokens") or 0 for m in metas)
    generated = sum(m["completion_tokens"] for m in metas)
    queries = after.get("prefix_cache_queries", 0.0) - before.get("prefix_cache_queries", 0.0)
    hits = after.get("prefix_cache_hits", 0.0) - before.get("prefix_cache_hits", 0.0)
    busy, total = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return {
        "seconds": round(elapsed, 3),
        "programs_per_s": round(len(batch) / elapsed, 3),
        "gen_tokens_per_s": round(generated / elapsed, 2),
        "requests": len(metas),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "generated_tokens": generated,
        "client_hit_rate": round(cached / prompt, 4) if prompt else None,
        "server_hit_rate": round(hits / queries, 4) if queries else None,
        "cpu_busy": round(busy / total, 3) if total else None,
    }


def best_of(repeats: int, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    runs = [fn() for _ in range(repeats)]
    best = max(runs, key=lambda r: r["gen_tokens_per_s"])
    rates = [r["gen_tokens_per_s"] for r in runs]
    return {**best, "runs_gen_tokens_per_s": rates, "median_gen_tokens_per_s": statistics.median(rates)}


# ------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="model folder served by both servers")
    p.add_argument("--num-programs", type=int, default=32, help="programs per multi-turn batch (32)")
    p.add_argument("--turns", type=int, default=4, help="chat turns per multi-turn program (4)")
    p.add_argument("--fork-programs", type=int, default=8, help="programs in the fork-heavy batch (8)")
    p.add_argument("--fork-width", type=int, default=4, help="branches per fork (4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per gen (16)")
    p.add_argument("--system-sentences", type=int, default=24, help="sentences in the shared system prompt")
    p.add_argument("--doc-sentences", type=int, default=16, help="sentences in each fork program's document")
    p.add_argument("--repeats", type=int, default=2, help="runs per cell; the best is reported (2)")
    p.add_argument("--server-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="extra ServerArgs field for both servers, e.g. device=cpu (repeatable)")
    p.add_argument("--output", help="write the JSON here instead of stdout")
    p.add_argument("--markdown", help="write the Markdown table here instead of stderr")
    return p.parse_args(argv)


def server_kwargs(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            out[name.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[name.replace("-", "_")] = value
    return out


def run_mode(args: argparse.Namespace, disable_radix_cache: bool) -> dict[str, Any]:
    multi = make_multi_turn(SYSTEM_SENTENCE * args.system_sentences, args.turns, args.max_tokens)
    forky = make_fork_heavy(args.fork_width, args.max_tokens)
    runtime = sgl.Runtime(model_path=args.model_path, disable_radix_cache=disable_radix_cache,
                          **server_kwargs(args.server_arg))
    try:
        multi.run_batch(multi_turn_batch(2, 1), temperature=0, backend=runtime)  # warm-up
        return {
            "multi_turn": best_of(args.repeats, lambda: run_once(
                multi, multi_turn_batch(args.num_programs, args.turns), runtime)),
            "fork_heavy": best_of(args.repeats, lambda: run_once(
                forky, fork_batch(args.fork_programs, args.doc_sentences), runtime)),
        }
    finally:
        runtime.shutdown()


def markdown(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| workload | radix cache | programs/s | gen tok/s (best) | gen tok/s (median) | client hit rate "
            "| server hit rate | CPU busy |", "|---|---|---|---|---|---|---|---|"]
    for mode, workloads in results.items():
        for name, r in workloads.items():
            rows.append(f"| {name} | {mode} | {r['programs_per_s']} | {r['gen_tokens_per_s']} | {r['median_gen_tokens_per_s']} | "
                        f"{r['client_hit_rate']} | {r['server_hit_rate']} | {r['cpu_busy']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = {"on": run_mode(args, disable_radix_cache=False), "off": run_mode(args, disable_radix_cache=True)}
    report = {"config": vars(args), "results": results}
    text = json.dumps(report, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    table = markdown(results)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    else:
        print(table, file=sys.stderr)


if __name__ == "__main__":
    main()
