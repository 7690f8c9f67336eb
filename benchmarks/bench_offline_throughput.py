"""Offline throughput: radixlm.Engine against HF `model.generate` on the same weights, one run.

The workload: --num-requests requests of random token ids, prompt lengths uniform in
[--min-input, --max-input], output lengths uniform in [--min-output, --max-output], all with
ignore_eos (every request generates exactly its output length), greedy.

  Engine  all requests submitted at once; continuous batching, at most --max-running-requests
          running at a time
  HF      static batches of --hf-batch-size in arrival order, left-padded; each batch generates to
          the longest output in it (min_new_tokens = max_new_tokens), which is what a server built
          on generate() does; only the tokens each request asked for count as its output

Both report output tokens/s (requested output tokens / wall time); the ratio is Engine / HF.
Memory: a thread polls engine.get_server_info() and records the KV slots held by running
requests (total - free - evictable) against the tokens those requests have (kv_request_tokens);
the difference is paging waste. The RSS of the engine's scheduler process and the HF process'
RSS growth are reported side by side.

examples:
  python benchmarks/bench_offline_throughput.py                     # 256 requests, 0.5B Qwen2-shaped bf16
  python benchmarks/bench_offline_throughput.py --model-size tiny --num-requests 16 --max-input 64 --max-output 16
  python benchmarks/bench_offline_throughput.py --vocab-size 32000 --skip-hf --engine-arg chunked_prefill_size=2048
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import random
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

NAME = "bench_offline_throughput"


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, in arrival order."""
    rng = random.Random(args.seed)
    return [([rng.randrange(3, vocab_size) for _ in range(rng.randint(args.min_input, args.max_input))],
             rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]


# ----------------------------------------------------------------- engine
class KVPoller:
    """Polls the engine's scheduler state in a thread: KV held vs needed, and the scheduler RSS."""

    def __init__(self, engine: Any, pid: int | None, interval: float):
        self.engine, self.pid, self.interval = engine, pid, interval
        self.samples: list[dict[str, Any]] = []
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-poller", daemon=True)

    def __enter__(self) -> KVPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                state = self.engine.get_server_info()["internal_states"][0]
            except Exception:     # noqa: BLE001 - the engine may be shutting down
                return
            held = state["kv_total_tokens"] - state["kv_free_tokens"] - state["kv_evictable_tokens"]
            self.samples.append({"held": held, "needed": state.get("kv_request_tokens"),
                                 "running": state.get("num_running_reqs"), "total": state["kv_total_tokens"]})
            if self.pid:
                self.peak_rss = max(self.peak_rss, common.rss_bytes(self.pid))

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"samples": 0}
        peak = max(self.samples, key=lambda s: s["held"])
        out: dict[str, Any] = {"samples": len(self.samples), "kv_total_tokens": peak["total"],
                               "peak_held_tokens": peak["held"], "needed_at_peak": peak["needed"],
                               "running_at_peak": peak["running"]}
        if peak["needed"] is not None and peak["held"]:
            out["waste_at_peak"] = (peak["held"] - peak["needed"]) / peak["held"]
            busy = [s for s in self.samples if s["held"] >= 0.5 * peak["held"]]
            out["max_waste_when_busy"] = max((s["held"] - s["needed"]) / s["held"] for s in busy)
        return out


def scheduler_pid(engine: Any) -> int | None:
    procs = engine.subprocesses.processes if engine.subprocesses else {}
    return next((p.pid for name, p in procs.items() if name.startswith("scheduler")), None)


def run_engine(args: argparse.Namespace, model_path: str, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    from radixlm import Engine

    kwargs: dict[str, Any] = dict(dtype="bfloat16", device="cpu", max_running_requests=args.max_running_requests,
                                  page_size=args.page_size, log_level="error",
                                  max_total_tokens=args.max_total_tokens or
                                  args.max_running_requests * (args.max_input + args.max_output + args.page_size))
    kwargs.update(args.engine_arg)
    engine = Engine(model_path=model_path, **kwargs)
    try:
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params=[{"max_new_tokens": 4, "ignore_eos": True}])
        pid = scheduler_pid(engine)
        rss_idle = common.rss_bytes(pid) if pid else 0
        with KVPoller(engine, pid, args.poll_interval) as poller:
            t0 = time.perf_counter()
            outs = asyncio.run(_generate_all(engine, work))
            wall = time.perf_counter() - t0
        rss = common.rss_breakdown(pid) if pid else {}
        out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        expected = sum(n for _, n in work)
        if out_tokens != expected:
            print(f"warning: engine produced {out_tokens} output tokens, the workload asked for {expected}")
        return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
                "total_tok_s": (out_tokens + sum(len(p) for p, _ in work)) / wall,
                "engine_args": kwargs, "kv": poller.summary(),
                "scheduler_rss_idle_mib": rss_idle / 2**20, "scheduler_rss_at_end_mib": rss,
                "scheduler_rss_peak_mib": max(poller.peak_rss, common.rss_bytes(pid, peak=True) if pid else 0) / 2**20,
                "max_total_tokens": engine.scheduler_info.get("max_total_tokens"),
                "kv_bytes_per_token": engine.scheduler_info.get("kv_bytes_per_token")}
    finally:
        engine.shutdown()


async def _generate_all(engine: Any, work: list[tuple[list[int], int]]) -> list[dict[str, Any]]:
    bar = tqdm(total=len(work), desc="engine", unit="req")

    async def one(ids: list[int], n: int) -> dict[str, Any]:
        out = await engine.async_generate(input_ids=ids, sampling_params={
            "max_new_tokens": n, "ignore_eos": True, "temperature": 0.0})
        bar.update(1)
        return out

    outs = await asyncio.gather(*(one(ids, n) for ids, n in work))
    bar.close()
    return outs


# ----------------------------------------------------------------- HF
class RSSSampler(threading.Thread):
    def __init__(self, interval: float = 0.2):
        super().__init__(name="rss-sampler", daemon=True)
        self.interval, self.peak = interval, common.rss_bytes(os.getpid())
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.peak = max(self.peak, common.rss_bytes(os.getpid()))


@torch.inference_mode()
def run_hf(args: argparse.Namespace, model_path: str, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    rss_before = common.rss_bytes(os.getpid())
    sampler = RSSSampler()
    sampler.start()
    from radixlm.runtime.models.resolve import hf_pretrained_args

    path, gguf_kwargs = hf_pretrained_args(model_path)  # a .gguf: its folder + gguf_file=
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **gguf_kwargs).eval()
    rss_loaded = common.rss_bytes(os.getpid())
    bs = args.hf_batch_size
    _hf_batch(model, [([5, 6, 7, 8], 4)])      # warm-up
    t0 = time.perf_counter()
    computed, batch_walls = 0, []
    for i in tqdm(range(0, len(work), bs), desc="HF generate", unit="batch"):
        tb = time.perf_counter()
        computed += _hf_batch(model, work[i:i + bs])
        batch_walls.append(round(time.perf_counter() - tb, 2))
    wall = time.perf_counter() - t0
    sampler.stop_event.set()
    sampler.join()
    rss_end = common.rss_breakdown(os.getpid())
    useful = sum(n for _, n in work)
    return {"wall_s": wall, "output_tokens": useful, "output_tok_s": useful / wall,
            "total_tok_s": (useful + sum(len(p) for p, _ in work)) / wall,
            "generated_tokens_incl_padding": computed, "batch_size": bs, "batch_walls_s": batch_walls,
            "rss_before_mib": rss_before / 2**20, "rss_loaded_mib": rss_loaded / 2**20,
            "rss_peak_mib": sampler.peak / 2**20, "rss_at_end_mib": rss_end, "rss_growth_peak_mib": (sampler.peak - rss_before) / 2**20}


def _hf_batch(model: Any, batch: list[tuple[list[int], int]]) -> int:
    """One left-padded static batch generated to its longest output; returns tokens generated."""
    longest = max(len(p) for p, _ in batch)
    ids = torch.zeros((len(batch), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, _) in enumerate(batch):
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    new = max(n for _, n in batch)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return (out.shape[1] - longest) * len(batch)


# ----------------------------------------------------------------- main
def parse_engine_arg(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key.replace("-", "_"), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.replace("-", "_"), value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_offline_throughput.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--num-requests", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--min-input", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--max-input", type=int, default=512, help="(default: %(default)s)")
    p.add_argument("--min-output", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--max-output", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=64, help="engine cap (default: %(default)s)")
    p.add_argument("--hf-batch-size", type=int, help="HF static batch size (default: --max-running-requests)")
    p.add_argument("--page-size", type=int, default=16, help="engine KV page size (default: %(default)s)")
    p.add_argument("--max-total-tokens", type=int,
                   help="engine KV pool (default: max-running-requests x (max-input + max-output + page))")
    p.add_argument("--engine-arg", type=parse_engine_arg, action="append", default=[], metavar="KEY=VALUE",
                   help="extra Engine/ServerArgs keyword, repeatable (e.g. chunked_prefill_size=2048)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for HF (default: %(default)s)")
    p.add_argument("--poll-interval", type=float, default=0.5, help="KV state poll period s (default: %(default)s)")
    p.add_argument("--skip-hf", action="store_true", help="run the engine only")
    p.add_argument("--skip-engine", action="store_true", help="run HF only")
    p.add_argument("--seed", type=int, default=0)
    common.add_output_dir_arg(p)
    args = p.parse_args(argv)
    args.engine_arg = dict(args.engine_arg)
    args.hf_batch_size = args.hf_batch_size or args.max_running_requests
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.model_path or common.make_qwen2_model(args.model_size, args.vocab_size)
    from transformers import AutoConfig

    from radixlm.runtime.models.gguf_loader import gguf_num_params
    from radixlm.runtime.models.resolve import resolve_model_source

    source = resolve_model_source(model_path)   # a .gguf (or smollm2-135m-instruct): config from its metadata
    model_path = source.model_path
    vocab = AutoConfig.from_pretrained(source.tokenizer_path or model_path).vocab_size
    work = make_workload(args, vocab)
    params = gguf_num_params(model_path) if source.tokenizer_path else common.count_params(model_path)
    results: dict[str, Any] = {
        "model_path": model_path, "num_params": params, "vocab_size": vocab,
        "workload": {"num_requests": len(work), "input_tokens": sum(len(p) for p, _ in work),
                     "output_tokens": sum(n for _, n in work), "input_range": [args.min_input, args.max_input],
                     "output_range": [args.min_output, args.max_output]}}
    with common.LoadMonitor() as load_engine:
        results["engine"] = None if args.skip_engine else run_engine(args, model_path, work)
    results["load_engine"] = load_engine.summary()
    if not args.skip_hf:        # save the engine half first: the HF half can take much longer
        common.write_results(NAME, args.output_dir, {**results, "partial": "HF generate still running"},
                             table_of(results), results["load_engine"])
    with common.LoadMonitor() as load_hf:
        results["hf"] = None if args.skip_hf else run_hf(args, model_path, work)
    results["load_hf"] = load_hf.summary()
    if results["engine"] and results["hf"]:
        results["speedup"] = results["engine"]["output_tok_s"] / results["hf"]["output_tok_s"]
    load = combined_load(results["load_engine"], results["load_hf"])
    common.write_results(NAME, args.output_dir, results, table_of(results), load)
    return results


def combined_load(sa: dict[str, Any], sb: dict[str, Any]) -> dict[str, Any]:
    """Load over both phases, weighted by their durations."""
    wa, wb = sa["wall_s"], sb["wall_s"]
    total = max(wa + wb, 1e-9)
    out = {**sa, "wall_s": round(wa + wb, 3)}
    for key in ("busy_fraction", "own_busy_fraction", "other_busy_fraction"):
        out[key] = round((sa[key] * wa + sb[key] * wb) / total, 3)
    return out


def table_of(r: dict[str, Any]) -> str:
    headers = ["runner", "wall s", "output tok/s", "total tok/s", "peak RSS MiB", "notes"]
    rows = []
    e, h = r.get("engine"), r.get("hf")
    if e:
        kv = e["kv"]
        note = (f"KV peak held {kv.get('peak_held_tokens')} slots, needed {kv.get('needed_at_peak')} "
                f"(waste {kv['waste_at_peak']:.1%})" if "waste_at_peak" in kv else "KV waste not reported")
        anon = e["scheduler_rss_at_end_mib"].get("RssAnon")
        rows.append(["radixlm Engine", e["wall_s"], e["output_tok_s"], e["total_tok_s"],
                     e["scheduler_rss_peak_mib"], f"scheduler process (anon {common.fmt(anon, 0)} MiB); {note}"])
    if h:
        rows.append(["HF generate", h["wall_s"], h["output_tok_s"], h["total_tok_s"], h["rss_peak_mib"],
                     f"static batches of {h['batch_size']}, {h['generated_tokens_incl_padding']} tokens generated "
                     f"incl. padding; whole process (anon {common.fmt(h['rss_at_end_mib'].get('RssAnon'), 0)} MiB), "
                     f"growth {h['rss_growth_peak_mib']:.0f} MiB"])
    text = common.markdown_table(headers, rows)
    w = r["workload"]
    text += (f"\n\nWorkload: {w['num_requests']} requests, {w['input_tokens']} prompt + {w['output_tokens']} "
             f"output tokens; model {r['num_params'] / 1e6:.1f}M params (vocab {r['vocab_size']}), bf16.")
    if "speedup" in r:
        text += f" Engine / HF output throughput: **{r['speedup']:.2f}x**."
    return text


if __name__ == "__main__":
    main()
