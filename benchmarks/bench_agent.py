"""The `agent` dataset of bench_serving.py: multi-turn tool loops with a growing history.

Each conversation is a system prompt and a user task, then `--turns` steps. Every step is one
streamed `/v1/chat/completions` request with `tools` (and `tool_choice`, default `required`, so
even a random model calls a tool); the assistant message with its `tool_calls` and one `tool`
result message per call (random text of --input-len tokens) are appended for the next step. The
server must run with `--tool-call-parser` and a tool-capable chat template.

Reported per turn: TTFT (first chunk of the stream, i.e. the first generated token), the prompt
tokens, the cached tokens the server reports, and the fraction of the previous step's prompt +
completion found in the cache (1.0 means the whole history was a hit).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import common
import httpx
import orjson
from tqdm import tqdm

TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 24}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "enum": [1, 2, 3]}},
            "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": ["README.md", "main.py"]}},
                       "required": ["path"]}}},
]


@dataclass
class AgentStep:
    conversation: int
    turn: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    history_tokens: int = 0          # previous step's prompt + completion
    message: dict[str, Any] = field(default_factory=dict)


async def stream_step(http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str],
                      step: AgentStep) -> None:
    """Streams one chat request; fills step (timings, usage, and the assembled assistant message)."""
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    start = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            step.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = orjson.loads(line[5:].strip())
            if "error" in chunk:
                step.error = str(chunk["error"])[:300]
                return
            if step.ttft == 0.0 and chunk.get("choices"):
                step.ttft = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                step.prompt_tokens = usage["prompt_tokens"]
                step.output_tokens = usage["completion_tokens"]
                step.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                content += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(tc["index"], {"id": "", "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                    slot["id"] += tc.get("id") or ""
                    fn = tc.get("function") or {}
                    slot["function"]["name"] += fn.get("name") or ""
                    slot["function"]["arguments"] += fn.get("arguments") or ""
    step.latency = time.perf_counter() - start
    step.message = {"role": "assistant", "content": content or None}
    if calls:
        step.message["tool_calls"] = [calls[i] for i in sorted(calls)]
    step.ok = step.output_tokens > 0


async def run_agent(args: argparse.Namespace, http: httpx.AsyncClient, maker: Any, model: str,
                    concurrency: int | None) -> tuple[list[AgentStep], float, int]:
    """Runs every conversation (--num-conversations, --turns steps each); returns (steps, seconds, skipped)."""
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=args.num_conversations * args.turns, desc="agent steps", unit="req", disable=args.quiet)
    steps: list[AgentStep] = []
    skipped = 0

    async def conversation(c: int) -> None:
        nonlocal skipped
        messages = [{"role": "system", "content": "You are an agent. " + maker.text(rng.randint(*args.input_len))},
                    {"role": "user", "content": maker.text(rng.randint(*args.input_len))}]
        history = 0
        for turn in range(args.turns):
            step = AgentStep(c, turn, history_tokens=history)
            body = {"model": model, "messages": messages, "tools": TOOLS, "tool_choice": args.agent_tool_choice,
                    "max_tokens": rng.randint(*args.output_len) + 64, "temperature": args.temperature,
                    "stream": True, "stream_options": {"include_usage": True}, "seed": args.seed + c * 100 + turn}
            async with sem if sem else nullcontext():
                try:
                    await stream_step(http, body, args.headers, step)
                except (httpx.HTTPError, ValueError) as e:
                    step.error = f"{type(e).__name__}: {e}"
            steps.append(step)
            bar.update(1)
            if not step.ok:
                skipped += args.turns - turn - 1
                bar.update(args.turns - turn - 1)
                return
            history = step.prompt_tokens + step.output_tokens
            messages = messages + [step.message] + [
                {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                 "content": maker.text(rng.randint(*args.input_len))}
                for call in step.message.get("tool_calls", [])]
            if not step.message.get("tool_calls"):
                messages.append({"role": "user", "content": maker.text(rng.randint(*args.input_len))})
            if args.context_len and history + 2 * args.input_len[1] + args.output_len[1] + 128 > args.context_len:
                skipped += args.turns - turn - 1
                bar.update(args.turns - turn - 1)
                return

    start = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(args.num_conversations)))
    bar.close()
    return steps, time.perf_counter() - start, skipped


def summarize_agent(steps: list[AgentStep], duration: float, concurrency: int | None,
                    hit_rate: float | None) -> dict[str, Any]:
    """Overall and per-turn figures (TTFT, cached tokens, history reuse)."""
    ok = [s for s in steps if s.ok]
    per_turn = []
    for turn in sorted({s.turn for s in ok}):
        group = [s for s in ok if s.turn == turn]
        reuse = [min(1.0, s.cached_tokens / s.history_tokens) for s in group if s.history_tokens]
        per_turn.append({
            "turn": turn, "requests": len(group), "ttft_ms": common.summarize([s.ttft for s in group], 1e3),
            "prompt_tokens_mean": sum(s.prompt_tokens for s in group) / len(group),
            "cached_tokens_mean": sum(s.cached_tokens for s in group) / len(group),
            "cached_fraction_of_prompt": sum(s.cached_tokens for s in group) / max(1, sum(s.prompt_tokens for s in group)),
            "history_reuse": sum(reuse) / len(reuse) if reuse else None,
            "tool_calls_mean": sum(len(s.message.get("tool_calls", [])) for s in group) / len(group),
        })
    return {
        "max_concurrency": concurrency, "request_rate": float("inf"), "completed": len(ok),
        "failed": len(steps) - len(ok), "errors": sorted({s.error for s in steps if s.error})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": sum(s.output_tokens for s in ok) / duration if duration else 0.0,
        "total_input_tokens": sum(s.prompt_tokens for s in ok),
        "total_output_tokens": sum(s.output_tokens for s in ok),
        "ttft_ms": common.summarize([s.ttft for s in ok], 1e3),
        "tpot_ms": common.summarize([], 1e3), "itl_ms": common.summarize([], 1e3),
        "e2e_latency_ms": common.summarize([s.latency for s in ok], 1e3),
        "cache_hit_rate": hit_rate, "per_turn": per_turn,
    }


def per_turn_table(runs: list[dict[str, Any]]) -> str:
    headers = ["concurrency", "turn", "requests", "TTFT p50/p90 ms", "prompt tok", "cached tok",
               "cached/prompt", "history reuse", "calls/step"]
    rows = []
    for r in runs:
        for t in r.get("per_turn", []):
            reuse = t["history_reuse"]
            rows.append([r["max_concurrency"] or "inf", t["turn"], t["requests"],
                         "/".join(common.fmt(t["ttft_ms"][k], 1) for k in ("p50", "p90")),
                         round(t["prompt_tokens_mean"]), round(t["cached_tokens_mean"]),
                         f"{t['cached_fraction_of_prompt']:.1%}", "-" if reuse is None else f"{reuse:.1%}",
                         round(t["tool_calls_mean"], 2)])
    return common.markdown_table(headers, rows)
