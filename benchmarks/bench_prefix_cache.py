"""The seed experiment: what a shared prompt prefix buys, through the OpenAI SDK.

A long system prompt (about --system-tokens tokens) plus a short question per request;
--num-requests concurrent streamed chat completions with --max-tokens output tokens. It runs
two passes:

  unique   a random uuid at the FRONT of the system prompt, so no request can reuse another's
           cached prefix: every request prefills the whole system prompt
  shared   the same system prompt for every request: after one warm-up request has cached it,
           each request only prefills its question

and prints p50 TTFT and throughput of both, and the ratios. Before each pass the cache is flushed
(POST /flush_cache) and one untimed warm-up request of that pass's kind is sent. The hit rate comes
from usage.prompt_tokens_details.cached_tokens and from /metrics.

examples:
  python benchmarks/bench_prefix_cache.py --launch                      # the bundled demo model
  python benchmarks/bench_prefix_cache.py --launch --model-path ./m --server-args "--dtype bfloat16"
  python benchmarks/bench_prefix_cache.py --base-url http://127.0.0.1:30000 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import httpx  # noqa: E402
from bench_serving import cache_counters, hit_rate, settled_counters  # noqa: E402
from tqdm import tqdm  # noqa: E402

NAME = "bench_prefix_cache"
TOPICS = ("billing", "shipping", "returns", "warranty", "accounts", "privacy", "payments", "orders",
          "discounts", "repairs", "security", "delivery", "refunds", "support", "pricing", "stock")


def system_prompt(num_tokens: int, count_tokens: Any) -> str:
    """A readable, deterministic policy text of about `num_tokens` tokens."""
    lines = ["You are a careful assistant for an online shop. Follow every rule below."]
    i = 0
    while True:
        topic = TOPICS[i % len(TOPICS)]
        line = (f"Rule {i + 1}: when a customer asks about {topic} (case {i * 7 % 101}), answer in one "
                f"short sentence, quote policy section {i % 13 + 1}, and never invent order numbers.")
        if count_tokens("\n".join([*lines, line])) > num_tokens:
            return "\n".join(lines)
        lines.append(line)
        i += 1


@dataclass
class ChatResult:
    ttft: float
    latency: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None


async def one_chat(client: Any, model: str, system: str, question: str, args: argparse.Namespace) -> ChatResult:
    start = time.perf_counter()
    ttft = None
    usage = None
    chunks = 0
    extra = {"ignore_eos": True} if args.ignore_eos else None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=args.max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body=extra)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - start
    latency = time.perf_counter() - start
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return ChatResult(ttft=ttft if ttft is not None else latency, latency=latency,
                      completion_tokens=usage.completion_tokens if usage else chunks,
                      prompt_tokens=usage.prompt_tokens if usage else 0,
                      cached_tokens=getattr(details, "cached_tokens", None) if details else None)


async def run_pass(mode: str, client: Any, http: httpx.AsyncClient, model: str, base: str,
                   args: argparse.Namespace) -> dict[str, Any]:
    """One timed pass of `args.num_requests` concurrent requests (mode: unique or shared)."""
    def system_for() -> str:
        return f"Session {uuid.uuid4()}.\n{base}" if mode == "unique" else base

    try:
        await http.post("/flush_cache", headers=args.headers)
    except httpx.HTTPError:
        pass
    await one_chat(client, model, system_for(), "Warm-up: say hello.", args)
    questions = [f"Question {i}: what does rule {i * 3 % 40 + 1} say about {TOPICS[i % len(TOPICS)]}?"
                 for i in range(args.num_requests)]
    before = await cache_counters(http)
    bar = tqdm(total=args.num_requests, desc=f"{mode} pass", unit="req", disable=args.quiet)

    async def tracked(q: str) -> ChatResult:
        res = await one_chat(client, model, system_for(), q, args)
        bar.update(1)
        return res

    start = time.perf_counter()
    results = await asyncio.gather(*(tracked(q) for q in questions))
    wall = time.perf_counter() - start
    bar.close()
    after = await settled_counters(http)
    ttfts = [r.ttft for r in results]
    cached = [r.cached_tokens for r in results if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in results)
    out_tokens = sum(r.completion_tokens for r in results)
    return {
        "mode": mode, "wall_s": wall, "ttft_ms": common.summarize(ttfts, 1e3),
        "e2e_ms": common.summarize([r.latency for r in results], 1e3),
        "output_throughput": out_tokens / wall, "request_throughput": len(results) / wall,
        "prompt_tokens_mean": prompt / len(results), "completion_tokens": out_tokens,
        "cached_token_fraction": sum(cached) / prompt if cached and prompt else None,
        "metrics_hit_rate": hit_rate(before, after), "ttft_s_all": [round(t, 5) for t in ttfts],
    }


async def discover(http: httpx.AsyncClient, args: argparse.Namespace) -> tuple[str, int | None, Any]:
    """Model id, its context length, and a token counter (the server's tokenizer when local)."""
    data = (await http.get("/v1/models", headers=args.headers)).json()["data"][0]
    model = args.model or data["id"]
    tok_path = args.tokenizer
    if not tok_path:
        try:
            info = (await http.get("/get_model_info", headers=args.headers)).json()
            tok_path = info.get("tokenizer_path") or info.get("model_path")
        except (httpx.HTTPError, ValueError):
            tok_path = None
    if tok_path and os.path.isdir(tok_path):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_path)
        return model, data.get("max_model_len"), lambda s: len(tok.encode(s, add_special_tokens=False))
    return model, data.get("max_model_len"), lambda s: len(s) // 4      # rough: 4 characters a token


async def bench(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    import openai

    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout) as http:
        model, context_len, count = await discover(http, args)
        budget = args.system_tokens
        if context_len:
            budget = min(budget, context_len - args.max_tokens - 96)     # room for uuid, question, template
        base = system_prompt(budget, count)
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=args.api_key or "none",
                                    timeout=args.timeout, max_retries=0)
        passes = []
        for _ in range(args.repeats):
            for mode in ("unique", "shared"):
                passes.append(await run_pass(mode, client, http, model, base, args))
        await client.close()
    return {"model": model, "context_len": context_len, "system_prompt_tokens": count(base),
            "num_requests": args.num_requests, "max_tokens": args.max_tokens, "passes": passes,
            **compare(passes)}


def compare(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Best (lowest) p50 TTFT and best throughput of each mode over the repeats, and the ratios."""
    def best(mode: str, key: str, pick: Any) -> float:
        return pick(p[key]["p50"] if key == "ttft_ms" else p[key] for p in passes if p["mode"] == mode)

    out = {f"{m}_{k}": best(m, k, f) for m in ("unique", "shared")
           for k, f in (("ttft_ms", min), ("output_throughput", max))}
    out["ttft_p50_ratio_unique_over_shared"] = out["unique_ttft_ms"] / out["shared_ttft_ms"]
    out["throughput_ratio_shared_over_unique"] = out["shared_output_throughput"] / out["unique_output_throughput"]
    medians = {m: statistics.median(p["ttft_ms"]["p50"] for p in passes if p["mode"] == m)
               for m in ("unique", "shared")}
    out["ttft_p50_ratio_median_over_repeats"] = medians["unique"] / medians["shared"]
    return out


def table_of(results: dict[str, Any]) -> str:
    headers = ["pass", "TTFT p50 ms", "TTFT p90 ms", "e2e p50 ms", "out tok/s", "req/s", "cached tokens",
               "/metrics hit rate"]
    rows = [[p["mode"], p["ttft_ms"]["p50"], p["ttft_ms"]["p90"], p["e2e_ms"]["p50"], p["output_throughput"],
             p["request_throughput"], _pct(p["cached_token_fraction"]), _pct(p["metrics_hit_rate"])]
            for p in results["passes"]]
    text = common.markdown_table(headers, rows)
    text += (f"\n\n{results['num_requests']} concurrent requests, system prompt "
             f"{results['system_prompt_tokens']} tokens, max_tokens {results['max_tokens']}. "
             f"p50 TTFT unique/shared: **{results['ttft_p50_ratio_unique_over_shared']:.1f}x** (best of each); "
             f"throughput shared/unique: **{results['throughput_ratio_shared_over_unique']:.1f}x**.")
    return text


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "-"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_prefix_cache.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server URL (default: %(default)s)")
    p.add_argument("--launch", action="store_true", help="start python -m radixlm.launch_server for the run")
    p.add_argument("--model-path", help="with --launch: the model (default: the bundled demo model)")
    p.add_argument("--server-args", default="", help="with --launch: extra server flags, one quoted string")
    p.add_argument("--model", help="model id (default: the first of /v1/models)")
    p.add_argument("--tokenizer", help="tokenizer folder to size the system prompt (default: the server's)")
    p.add_argument("--api-key", help="API key for the server")
    p.add_argument("--num-requests", type=int, default=16, help="concurrent requests per pass (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=2000,
                   help="system prompt length, capped by the model's context (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default: %(default)s)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every request generates --max-tokens (default: on)")
    p.add_argument("--repeats", type=int, default=1, help="unique+shared pass pairs (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout s (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--result-name", default=NAME, help="file name stem of the results (default: %(default)s)")
    common.add_output_dir_arg(p)
    args = p.parse_args(argv)
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results, load_summary = common.run_against_server(args, bench)
    common.write_results(args.result_name, args.output_dir, results, table_of(results), load_summary)
    return results


if __name__ == "__main__":
    main()
