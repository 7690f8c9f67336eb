"""Online serving benchmark: streams requests at a server and measures throughput and latency.

Works against radixlm's native API (`--backend radixlm`, POST /generate as SSE), radixlm's
OpenAI routes (`radixlm-openai`), or any OpenAI-compatible server (`openai`). With `--launch` it
starts `python -m radixlm.launch_server` itself (pass its flags with `--server-args`).

Datasets (nothing is downloaded; prompts are random token text from the served tokenizer):
  random                   input and output lengths drawn from --input-len / --output-len ranges
  generated-shared-prefix  --gsp-groups groups of --gsp-prompts-per-group requests; each group shares
                           a system prompt of --gsp-system-len tokens, then a random question
  multi-turn               --num-conversations conversations of --turns turns; each turn resends the
                           whole history (with the server's real replies) plus a new user message
  agent                    --num-conversations tool loops of --turns steps through the OpenAI chat
                           route with tools (bench_agent.py); reports TTFT and cache hits per turn

Load: --request-rate (Poisson arrivals, default inf: all at once) and/or --max-concurrency
(several values sweep, one run each). Reports request and output throughput, TTFT, TPOT
(time per output token after the first) and ITL (gap between tokens) at p50/p90/p99, and
the prefix-cache hit rate: the growth of radixlm:prefix_cache_hits_total over
radixlm:prefix_cache_queries_total in /metrics during the run.

Side by side: `--compare-base-url URL` (with `--compare-name`, `--compare-backend`, optionally
`--compare-launch CMD`) runs the same benchmark against a second server in the same invocation,
back to back, and writes one table with the ratios (see serving_compare.py).

examples:
  python benchmarks/bench_serving.py --launch --dataset generated-shared-prefix --max-concurrency 1 4 16
  python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --dataset random --num-prompts 64
  python benchmarks/bench_serving.py --backend openai --base-url http://127.0.0.1:8000 --model m --tokenizer ./m
  python benchmarks/bench_serving.py --launch --backend radixlm-openai --compare-base-url http://127.0.0.1:8000 \
      --compare-name vllm-cpu --max-concurrency 1 16 64 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_agent  # noqa: E402
import common  # noqa: E402
import httpx  # noqa: E402
import orjson  # noqa: E402
import serving_compare  # noqa: E402
from tqdm import tqdm  # noqa: E402

BACKENDS = ("radixlm", "radixlm-openai", "openai")
DATASETS = ("random", "generated-shared-prefix", "multi-turn", "agent")
TURN_OVERHEAD = 16          # chat-template tokens around one more message (an estimate)
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du", "ga", "ho", "ji", "zu", "fa", "we")


# ----------------------------------------------------------------- prompts
class PromptMaker:
    """Makes text of about N tokens: decoded random ids with a tokenizer, pseudo-words without one."""

    def __init__(self, tokenizer: Any, seed: int):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            self.ids = [i for i in range(len(tokenizer)) if i not in special]

    def text(self, num_tokens: int) -> str:
        if self.tokenizer is None:
            return " ".join("".join(self.rng.choices(SYLLABLES, k=2)) for _ in range(num_tokens))
        ids = self.rng.choices(self.ids, k=num_tokens)
        text = self.tokenizer.decode(ids)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]   # re-tokenization drifts
        return self.tokenizer.decode(ids)

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """Conversation as one prompt text for the native /generate route."""
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


@dataclass
class BenchRequest:
    messages: list[dict[str, str]]          # chat form; the native and completions APIs get it rendered
    output_len: int
    conversation: int | None = None         # multi-turn: which conversation
    turns: list[tuple[str, int]] = field(default_factory=list)   # multi-turn: later (user text, output len)
    raw: bool = False                       # random: send the text as is, without a chat template


def num_prompts(args: argparse.Namespace, concurrency: int | None) -> int:
    """--num-prompts: one value for every run, or one per --max-concurrency value, in order."""
    counts = args.num_prompts
    if len(counts) == 1 or concurrency is None:
        return counts[0]
    return counts[args.max_concurrency.index(concurrency)]


def make_dataset(args: argparse.Namespace, maker: PromptMaker, concurrency: int | None = None) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    in_len = lambda: rng.randint(*args.input_len)        # noqa: E731
    out_len = lambda: rng.randint(*args.output_len)      # noqa: E731
    if args.dataset == "random":
        return [BenchRequest([{"role": "user", "content": maker.text(in_len())}], out_len(), raw=True)
                for _ in range(num_prompts(args, concurrency))]
    if args.dataset == "generated-shared-prefix":
        systems = [maker.text(args.gsp_system_len) for _ in range(args.gsp_groups)]
        reqs = [BenchRequest([{"role": "system", "content": s}, {"role": "user", "content": maker.text(in_len())}],
                             out_len()) for s in systems for _ in range(args.gsp_prompts_per_group)]
        rng.shuffle(reqs)
        return reqs
    convs = []
    for c in range(args.num_conversations):
        turns = [(maker.text(in_len()), out_len()) for _ in range(args.turns)]
        first, rest = turns[0], turns[1:]
        convs.append(BenchRequest([{"role": "user", "content": first[0]}], first[1], c, rest))
    return convs


# ----------------------------------------------------------------- one streamed request
@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    cached_tokens: int | None = None


class Client:
    """Sends one request and times its stream. `kind` is native, completions or chat."""

    def __init__(self, args: argparse.Namespace, http: httpx.AsyncClient, maker: PromptMaker, model: str):
        self.args, self.http, self.maker, self.model = args, http, maker, model
        self.kind = "native" if args.backend == "radixlm" else args.openai_endpoint

    def payload(self, messages: list[dict[str, str]], output_len: int, raw: bool) -> tuple[str, dict[str, Any]]:
        a = self.args
        text = messages[-1]["content"] if raw else self.maker.render_chat(messages)
        if self.kind == "native":
            params = {"max_new_tokens": output_len, "temperature": a.temperature, "ignore_eos": a.ignore_eos}
            if a.ignore_eos:
                params["skip_special_tokens"] = False
            return "/generate", {"text": text, "sampling_params": params, "stream": True}
        body: dict[str, Any] = {"model": self.model, "max_tokens": output_len, "temperature": a.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if a.ignore_eos:          # past eos a model may emit only special tokens: shown, they time the first token
            body["ignore_eos"] = True
            body["skip_special_tokens"] = False
        if self.kind == "chat":
            return "/v1/chat/completions", {**body, "messages": messages}
        return "/v1/completions", {**body, "prompt": text}

    async def send(self, messages: list[dict[str, str]], output_len: int, raw: bool = False) -> RequestResult:
        path, body = self.payload(messages, output_len, raw)
        res = RequestResult()
        start = last = time.perf_counter()
        try:
            async with self.http.stream("POST", path, json=body, headers=self.args.headers) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    new = self._absorb(orjson.loads(data), res)
                    if new > 0:
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - start
                            new -= 1
                        res.itl.extend([(now - last) / new] * new if new else [])
                        last = now
            res.latency = time.perf_counter() - start
            res.ok = not res.error and res.output_tokens > 0
        except (httpx.HTTPError, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"
        return res

    def _absorb(self, chunk: dict[str, Any], res: RequestResult) -> int:
        """Takes one stream chunk into `res`; returns how many new tokens it carried."""
        if "error" in chunk:
            res.error = str(chunk["error"])[:300]
            return 0
        if self.kind == "native":
            meta = chunk.get("meta_info", {})
            res.text = chunk.get("text", res.text)
            res.prompt_tokens = meta.get("prompt_tokens", res.prompt_tokens)
            res.cached_tokens = meta.get("cached_tokens", res.cached_tokens)
            total = int(meta.get("completion_tokens", res.output_tokens))
            new, res.output_tokens = total - res.output_tokens, total
            return new
        usage = chunk.get("usage")
        if usage:             # the include_usage chunk: exact counts
            res.prompt_tokens = usage.get("prompt_tokens", 0)
            res.output_tokens = usage.get("completion_tokens", res.output_tokens)
            details = usage.get("prompt_tokens_details") or {}
            res.cached_tokens = details.get("cached_tokens", res.cached_tokens)
        choices = chunk.get("choices") or []
        if not choices:
            return 0
        piece = choices[0].get("delta", {}).get("content") if self.kind == "chat" else choices[0].get("text")
        if not piece:
            return 0
        res.text += piece
        res.output_tokens += 1    # a chunk per token; replaced by usage at the end
        return 1


# ----------------------------------------------------------------- one run
async def run_once(args: argparse.Namespace, client: Client, dataset: list[BenchRequest],
                   concurrency: int | None) -> tuple[list[RequestResult], float, int]:
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    total = sum(1 + len(r.turns) for r in dataset)
    bar = tqdm(total=total, desc=f"requests (concurrency {concurrency or 'inf'})", unit="req", disable=args.quiet)
    results: list[RequestResult] = []
    skipped: list[int] = []           # multi-turn: turns left out because the history outgrew the context
    rng = random.Random(args.seed + 1)

    async def one(messages: list[dict[str, str]], output_len: int, raw: bool = False) -> RequestResult:
        async with sem if sem else nullcontext():
            res = await client.send(messages, output_len, raw)
        results.append(res)
        bar.update(1)
        return res

    async def conversation(req: BenchRequest) -> None:
        messages = list(req.messages)
        res = await one(messages, req.output_len, req.raw)
        for k, (user_text, output_len) in enumerate(req.turns):
            # the next turn resends the history; stop the conversation once it would not fit
            grown = res.prompt_tokens + res.output_tokens + client.maker.count(user_text) + TURN_OVERHEAD
            if not res.ok or (args.context_len and grown + output_len > args.context_len):
                skipped.append(len(req.turns) - k)
                bar.update(len(req.turns) - k)
                return
            messages = [*messages, {"role": "assistant", "content": res.text}, {"role": "user", "content": user_text}]
            res = await one(messages, output_len)

    start = time.perf_counter()
    tasks = []
    for req in dataset:
        tasks.append(asyncio.create_task(conversation(req)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    await asyncio.gather(*tasks)
    bar.close()
    return results, time.perf_counter() - start, sum(skipped)


def summarize_run(results: list[RequestResult], duration: float, concurrency: int | None,
                  request_rate: float, hit_rate: float | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    timed = [r for r in ok if r.ttft > 0.0]      # a request whose stream carried no text has no first token time
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in timed if r.output_tokens > 1]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "max_concurrency": concurrency, "request_rate": request_rate, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "input_throughput": in_tokens / duration, "output_throughput": out_tokens / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": common.summarize([r.ttft for r in timed], 1e3),
        "untimed_requests": len(ok) - len(timed),
        "tpot_ms": common.summarize(tpot, 1e3),
        "itl_ms": common.summarize([x for r in ok for x in r.itl], 1e3),
        "e2e_latency_ms": common.summarize([r.latency for r in ok], 1e3),
        "cache_hit_rate": hit_rate,
        "client_cached_token_fraction": sum(cached) / in_tokens if cached and in_tokens else None,
        "ttft_s_all": [round(r.ttft, 5) for r in timed],
    }


# ----------------------------------------------------------------- server helpers
METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def parse_metric(text: str, name: str) -> float | None:
    """Sum of every sample of `name` in a Prometheus text page (None when absent)."""
    values = [float(m.group(3)) for line in text.splitlines()
              if (m := METRIC_LINE.match(line.strip())) and m.group(1) == name]
    return sum(values) if values else None


async def cache_counters(http: httpx.AsyncClient) -> tuple[float, float] | None:
    try:
        resp = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    hits = parse_metric(resp.text, "radixlm:prefix_cache_hits_total")
    queries = parse_metric(resp.text, "radixlm:prefix_cache_queries_total")
    return (hits, queries) if hits is not None and queries is not None else None


async def settled_counters(http: httpx.AsyncClient, min_wait: float = 1.2,
                           timeout: float = 5.0) -> tuple[float, float] | None:
    """Counters once they stop moving. The scheduler pushes its final counters when it notices it
    went idle, which can take up to its idle poll period (1 s); a /get_server_info call wakes it."""
    try:
        await http.get("/get_server_info")
    except httpx.HTTPError:
        pass
    start = time.monotonic()
    last = await cache_counters(http)
    while last is not None and time.monotonic() - start < timeout:
        await asyncio.sleep(0.4)
        now = await cache_counters(http)
        if now == last and time.monotonic() - start >= min_wait:
            return now
        last = now
    return last


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


async def discover(args: argparse.Namespace, http: httpx.AsyncClient) -> tuple[str, Any, int | None]:
    """The model name for OpenAI requests, a tokenizer (from --tokenizer or the server's path) and
    the context length (--max-context, else what the server reports)."""
    model, tok_path, context = args.model, args.tokenizer, args.max_context
    if args.backend != "radixlm":
        card = (await http.get("/v1/models", headers=args.headers)).json()["data"][0]
        model = model or card["id"]
        context = context or card.get("max_model_len")
    if args.backend != "openai":
        info = (await http.get("/get_model_info", headers=args.headers)).json()
        tok_path = tok_path or info.get("tokenizer_path") or info.get("model_path")
        context = context or info.get("max_model_len")
    tokenizer = None
    if tok_path and os.path.isdir(tok_path) or args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tok_path)
    return model or "default", tokenizer, context


# ----------------------------------------------------------------- main
async def bench(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        model, tokenizer, args.context_len = await discover(args, http)
        maker = PromptMaker(tokenizer, args.seed)
        client = Client(args, http, maker, model)
        for _ in range(args.warmup_requests):
            await client.send([{"role": "user", "content": maker.text(8)}], 4, raw=True)
        runs = []
        for concurrency in args.max_concurrency or [None]:
            if args.flush_cache and args.backend != "openai":
                await http.post("/flush_cache", headers=args.headers)
            before = await cache_counters(http)
            if args.dataset == "agent":
                steps, duration, skipped = await bench_agent.run_agent(
                    args, http, PromptMaker(tokenizer, args.seed), model, concurrency)
                after = await settled_counters(http)
                run = bench_agent.summarize_agent(steps, duration, concurrency, hit_rate(before, after))
                runs.append({**run, "turns_skipped_context": skipped})
                continue
            dataset = make_dataset(args, PromptMaker(tokenizer, args.seed), concurrency)
            results, duration, skipped = await run_once(args, client, dataset, concurrency)
            after = await settled_counters(http)
            run = summarize_run(results, duration, concurrency, args.request_rate, hit_rate(before, after))
            runs.append({**run, "turns_skipped_context": skipped})
    return {"base_url": base_url, "model": model, "tokenizer": getattr(tokenizer, "name_or_path", None),
            "runs": runs}


def table_of(runs: list[dict[str, Any]]) -> str:
    headers = ["concurrency", "rate", "done/failed", "req/s", "out tok/s", "TTFT p50/p90/p99 ms",
               "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "cache hit"]

    def three(d: dict[str, Any]) -> str:
        return "/".join(common.fmt(d[k], 1) for k in ("p50", "p90", "p99"))

    rows = [[r["max_concurrency"] or "inf", r["request_rate"], f"{r['completed']}/{r['failed']}",
             r["request_throughput"], r["output_throughput"], three(r["ttft_ms"]), three(r["tpot_ms"]),
             three(r["itl_ms"]), f"{r['cache_hit_rate']:.1%}" if r["cache_hit_rate"] is not None else "-"]
            for r in runs]
    text = common.markdown_table(headers, rows)
    if any("per_turn" in r for r in runs):
        text += "\n\nPer turn (agent):\n\n" + bench_agent.per_turn_table(runs)
    skipped = [r.get("turns_skipped_context", 0) for r in runs]
    if any(skipped):
        text += f"\n\nMulti-turn: {'/'.join(map(str, skipped))} later turns left out (history outgrew the context)."
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--backend", choices=BACKENDS, default="radixlm", help="API to talk (default: %(default)s)")
    g.add_argument("--base-url", default="http://127.0.0.1:30000", help="server URL (default: %(default)s)")
    g.add_argument("--launch", action="store_true", help="start python -m radixlm.launch_server for the run")
    g.add_argument("--model-path", help="with --launch: the model (default: the server's default model)")
    g.add_argument("--server-args", default="", help="with --launch: extra server flags, one quoted string")
    g.add_argument("--model", help="model name for OpenAI requests (default: the first of /v1/models)")
    g.add_argument("--tokenizer", help="tokenizer folder for making prompts (default: the server's, if local)")
    g.add_argument("--api-key", help="sent as Authorization: Bearer")
    g.add_argument("--max-context", type=int,
                   help="multi-turn: end a conversation before it outgrows this (default: the server's context)")
    g.add_argument("--openai-endpoint", choices=("completions", "chat"),
                   help="OpenAI route (default: chat for multi-turn, else completions)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random", help="(default: %(default)s)")
    g.add_argument("--num-prompts", type=int, nargs="+", default=[64],
                   help="random: number of requests; one value, or one per --max-concurrency value "
                        "(default: %(default)s)")
    g.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"),
                   help="prompt (random) / question (shared-prefix) / user turn tokens (default: %(default)s)")
    g.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"),
                   help="output tokens per request (default: %(default)s)")
    g.add_argument("--gsp-groups", type=int, default=4, help="shared-prefix groups (default: %(default)s)")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="(default: %(default)s)")
    g.add_argument("--gsp-system-len", type=int, default=512, help="shared prompt tokens (default: %(default)s)")
    g.add_argument("--num-conversations", type=int, default=16, help="multi-turn (default: %(default)s)")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation (default: %(default)s)")
    g.add_argument("--agent-tool-choice", default="required",
                   help="agent: tool_choice of every step: required, auto or none (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the output length (default: on for radixlm backends, off for openai)")
    g.add_argument("--seed", type=int, default=1)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests (conversations) per second, Poisson; inf sends all at once (default: %(default)s)")
    g.add_argument("--max-concurrency", type=int, nargs="*", default=None,
                   help="cap on requests in flight; several values run one benchmark each (default: no cap)")
    g.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="POST /flush_cache before each run (radixlm backends; default: on)")
    g.add_argument("--warmup-requests", type=int, default=1, help="untimed requests first (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout s (default: %(default)s)")
    g = p.add_argument_group("output")
    common.add_output_dir_arg(g)
    g.add_argument("--result-name", help="file name stem (default: bench_serving_<dataset>)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    serving_compare.add_compare_args(p)
    args = p.parse_args(argv)
    if len(args.num_prompts) not in (1, len(args.max_concurrency or [None])):
        p.error("--num-prompts takes one value or one per --max-concurrency value")
    if args.ignore_eos is None:
        args.ignore_eos = args.backend != "openai"
    if args.dataset == "agent" and args.backend == "radixlm":
        args.backend = "radixlm-openai"      # tools need the OpenAI chat route
    if args.openai_endpoint is None:
        args.openai_endpoint = "chat" if args.dataset in ("multi-turn", "agent") else "completions"
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.compare_base_url:
        results, load_summary = serving_compare.run(sys.modules[__name__], args)
        results["workload"] = {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")}
        name = args.result_name or f"bench_serving_{args.dataset}_vs_{args.compare_name}"
        common.write_results(name, args.output_dir, results, serving_compare.compare_table(results), load_summary)
        return results
    results, load_summary = common.run_against_server(args, bench)
    results["workload"] = {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")}
    name = args.result_name or f"bench_serving_{args.dataset}"
    common.write_results(name, args.output_dir, results, table_of(results["runs"]), load_summary)
    return results


if __name__ == "__main__":
    main()
