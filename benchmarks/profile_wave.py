"""Where a burst's time goes: `--num-prompts` requests arrive at once (no server, no IPC).

The serving benchmarks at concurrency 16 and 64 arrive in waves: every request of a wave has the
same output length, so they finish together and the next wave's prompts all arrive in one burst.
Time to first token is then set by how fast the scheduler prefills a burst beside the decodes that
are already running. This builds a real `Scheduler` in this process, runs a small warm-up burst,
then submits the timed one (random prompts of `--input-len MIN MAX` tokens, greedy, ignore_eos,
`--output-len` tokens) and steps until all finish, recording per step its prefill tokens, its
decodes and its wall time, split by wrapping the runner (profile_step.py's phases).

Reports: first-token time p50/max from the burst's start (in-process, so without the HTTP and
detokenizer hops), prefill tok/s over the steps that prefill, the first steps one by one, and the
mean decode-only step.

    python benchmarks/profile_wave.py --model-path /work/models/smollm2-135m-instruct --num-prompts 64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from profile_step import (PhaseTimer, instrument, make_scheduler, parse_scheduler_args,  # noqa: E402
                          scheduler_arg_parser)

NAME = "profile_wave"


def submit(sched: Any, tag: str, n: int, lens: tuple[int, int], out_len: int, rnd: random.Random) -> None:
    from radixlm.runtime.managers.io_struct import TokenizedGenerateReq
    from radixlm.runtime.sampling_params import SamplingParams

    vocab = sched.runner.model_config.vocab_size
    for i in range(n):
        ids = [rnd.randrange(3, vocab) for _ in range(rnd.randint(*lens))]
        params = SamplingParams(max_new_tokens=out_len, temperature=0.0, ignore_eos=True)
        sched.handle(TokenizedGenerateReq(rid=f"{tag}{i}", input_ids=ids, sampling_params=params))


def run_burst(sched: Any, args: argparse.Namespace) -> dict[str, Any]:
    rnd = random.Random(args.seed)
    lens = (args.input_len[0], args.input_len[-1])
    submit(sched, "warm", max(1, args.num_prompts // 8), lens, 4, rnd)
    while sched.running or sched.waiting:
        sched.step()
    timer = PhaseTimer()
    instrument(sched, timer)
    plan, kinds = sched.planner.plan, {}

    def counted_plan(running: list, waiting: list) -> Any:
        batch = plan(running, waiting)
        kinds["prefill"] = sum(n for r, n in zip(batch.reqs, batch.extend_lens) if r.kv_committed_len < r.prompt_len)
        kinds["decodes"] = sum(1 for r in batch.reqs if r.kv_committed_len >= r.prompt_len)
        return batch
    sched.planner.plan = counted_plan
    submit(sched, "t", args.num_prompts, lens, args.output_len, rnd)
    start, first, steps = time.perf_counter(), {}, []
    while sched.running or sched.waiting:
        kinds.update(prefill=0, decodes=0)
        t0 = time.perf_counter()
        sched.step()
        wall = time.perf_counter() - t0
        for req in sched.running:
            if req.output_ids and req.rid not in first:
                first[req.rid] = time.perf_counter() - start
        steps.append({"wall": wall, "forward": timer.take().get("model forward", 0.0), **kinds})
    sched.planner.plan = plan
    return summarize(steps, sorted(first.values()), time.perf_counter() - start, args, sched)


def summarize(steps: list[dict], first: list[float], total: float, args: argparse.Namespace,
              sched: Any) -> dict[str, Any]:
    prefill = [s for s in steps if s["prefill"]]
    decode = [s for s in steps if not s["prefill"]]
    prefill_s = sum(s["wall"] for s in prefill)
    return {
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "model_path": args.model_path, "dtype": str(sched.runner.dtype), "steps": len(steps), "total_s": total,
        "first_token_p50_s": statistics.median(first) if first else None,
        "first_token_max_s": first[-1] if first else None,
        "prefill_steps": len(prefill), "prefill_tokens": sum(s["prefill"] for s in prefill),
        "prefill_tok_per_s": sum(s["prefill"] for s in prefill) / prefill_s if prefill_s else None,
        "decode_step_ms_mean": 1e3 * statistics.fmean(s["wall"] for s in decode) if decode else None,
        "first_steps": prefill[:12],
    }


def table_of(r: dict[str, Any]) -> str:
    rows = [[i, s["prefill"], s["decodes"], f"{s['wall'] * 1e3:.0f}", f"{s['forward'] * 1e3:.0f}"]
            for i, s in enumerate(r["first_steps"])]
    text = common.markdown_table(["prefill step", "prompt tokens", "decodes", "wall ms", "model forward ms"], rows)
    p50 = r["first_token_p50_s"]
    text += (f"\n\n{r['num_prompts']} prompts of {r['input_len']} tokens, {r['output_len']} out ({r['dtype']}): "
             f"first token p50 {p50 if p50 is None else round(p50, 2)} s; prefill "
             f"{r['prefill_tok_per_s'] or 0:.0f} tok/s over {r['prefill_steps']} steps; decode-only step "
             f"{r['decode_step_ms_mean'] or 0:.1f} ms mean; {r['steps']} steps in {r['total_s']:.2f} s")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = scheduler_arg_parser("profile_wave.py", __doc__, max_total_tokens=131072)
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the burst (default: %(default)s)")
    p.add_argument("--input-len", type=int, nargs="+", default=[128, 512],
                   help="prompt tokens, MIN [MAX], uniform (default: 128 512, as bench_serving's runs)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=7)
    return parse_scheduler_args(p, argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with common.LoadMonitor() as load:
        result = run_burst(make_scheduler(args), args)
    common.write_results(f"{NAME}_n{args.num_prompts}", args.output_dir, result, table_of(result), load.summary())
    return result


if __name__ == "__main__":
    main()
