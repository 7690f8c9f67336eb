"""Where one scheduler step's wall time goes, at a fixed decode batch size (no server, no IPC).

It builds a real `Scheduler` in this process, admits `--batch-size` requests (random prompts of
`--input-len` tokens, greedy, ignore_eos), prefills them, then times `--steps` decode steps and
splits each into phases by wrapping the runner's methods:

    model forward     the transformer (embeddings to final norm) and the LM head
    attn metadata     the attention backend's per-step setup
    batch build       ForwardBatch construction (runner.make_forward_batch)
    sampling          OutputProcessor.sample (SamplingBatchInfo + Sampler)
    other             everything else in Scheduler.step: planning, KV allocation, token
                      bookkeeping, the radix cache, output messages

"Outside the model forward" is 1 - model forward / step. `--torch-profile` also prints the
top ops of one step from torch.profiler.

    python benchmarks/profile_step.py --model-path /work/models/smollm2-135m-instruct --batch-size 32
    python benchmarks/profile_step.py --model-size tiny --batch-size 4 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402

NAME = "profile_step"


class PhaseTimer:
    """Accumulates wall seconds per phase name for wrapped callables."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = 0            # only the outermost timed call counts (wrapped calls may nest)

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        """Replaces `obj.attr` by a timed call of the original (an instance attribute)."""
        inner = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            self._depth += 1
            try:
                return inner(*a, **kw)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds[phase] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def make_scheduler(args: argparse.Namespace) -> Any:
    from radixlm.runtime.managers.scheduler import Scheduler, set_torch_threads
    from radixlm.runtime.server_args import ServerArgs

    set_torch_threads()
    extra = dict(a.split("=", 1) for a in args.server_arg)
    server_args = ServerArgs(model_path=args.model_path, dtype=args.dtype, device="cpu",
                             max_total_tokens=args.max_total_tokens, **_typed(extra)).resolved()
    return Scheduler(server_args)


def _typed(extra: dict[str, str]) -> dict[str, Any]:
    from dataclasses import MISSING

    from radixlm.runtime.server_args import ServerArgs

    out: dict[str, Any] = {}
    for name, value in extra.items():
        field = ServerArgs.__dataclass_fields__[name]
        default = field.default if field.default_factory is MISSING else field.default_factory()
        if isinstance(default, bool):
            out[name] = value.lower() in ("1", "true", "yes")
        elif default is not None:
            out[name] = type(default)(value)
        else:                                   # an optional field (None until resolved): a number if it reads as one
            out[name] = int(value) if value.lstrip("-").isdigit() else value
    return out


def submit(sched: Any, batch_size: int, input_len: int, max_new_tokens: int, seed: int) -> None:
    from radixlm.runtime.managers.io_struct import TokenizedGenerateReq
    from radixlm.runtime.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = sched.runner.model_config.vocab_size
    for i in range(batch_size):
        ids = torch.randint(3, vocab, (input_len,), generator=gen).tolist()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        sched.handle(TokenizedGenerateReq(rid=f"r{i}", input_ids=ids, sampling_params=params))


def instrument(sched: Any, timer: PhaseTimer) -> None:
    runner = sched.runner
    timer.wrap(runner.model, "forward", "model forward")
    timer.wrap(runner, "decode_forward", "model forward")       # the compiled path skips model.forward
    timer.wrap(runner.model, "compute_logits", "model forward")
    timer.wrap(runner.attn_backend, "init_forward_metadata", "attn metadata")
    timer.wrap(runner, "make_forward_batch", "batch build")
    timer.wrap(sched.output, "sample", "sampling")


def profile(args: argparse.Namespace) -> dict[str, Any]:
    sched = make_scheduler(args)
    submit(sched, args.batch_size, args.input_len, args.warmup_steps + args.steps + 8, args.seed)
    while len(sched.running) < args.batch_size or any(r.kv_committed_len < r.prompt_len for r in sched.running):
        sched.step()                                            # prefill (possibly chunked)
    for _ in range(args.warmup_steps):
        sched.step()
    timer = PhaseTimer()
    instrument(sched, timer)
    steps: list[dict[str, float]] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        sched.step()
        total = time.perf_counter() - t0
        phases = timer.take()
        phases["other"] = total - sum(phases.values())
        steps.append({"step": total, **phases})
    top_ops = torch_profile(sched, args.torch_profile_rows) if args.torch_profile_rows else None
    return summarize(steps, args, sched, top_ops)


def torch_profile(sched: Any, rows: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        sched.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def summarize(steps: list[dict[str, float]], args: argparse.Namespace, sched: Any,
              top_ops: str | None) -> dict[str, Any]:
    names = sorted({k for s in steps for k in s if k != "step"})
    median_step = statistics.median(s["step"] for s in steps)
    mean_step = statistics.fmean(s["step"] for s in steps)
    phases = {n: statistics.fmean(s.get(n, 0.0) for s in steps) for n in names}
    return {
        "batch_size": args.batch_size, "input_len": args.input_len, "steps": len(steps),
        "model_path": args.model_path, "dtype": str(sched.runner.dtype),
        "torch_threads": torch.get_num_threads(),
        "step_ms_median": median_step * 1e3, "step_ms_mean": mean_step * 1e3,
        "phase_ms_mean": {n: v * 1e3 for n, v in phases.items()},
        "phase_fraction": {n: v / mean_step for n, v in phases.items()},
        "outside_model_forward_fraction": 1.0 - phases.get("model forward", 0.0) / mean_step,
        "top_ops": top_ops,
    }


def table_of(result: dict[str, Any]) -> str:
    rows = [[name, result["phase_ms_mean"][name], f"{frac:.1%}"]
            for name, frac in sorted(result["phase_fraction"].items(), key=lambda kv: -kv[1])]
    text = common.markdown_table(["phase", "ms per step (mean)", "share"], rows)
    text += (f"\n\nbatch {result['batch_size']}, prompt {result['input_len']} tokens, {result['steps']} decode steps: "
             f"step {result['step_ms_median']:.2f} ms median; **outside the model forward: "
             f"{result['outside_model_forward_fraction']:.1%}** ({result['dtype']}, "
             f"{result['torch_threads']} torch threads)")
    if result["top_ops"]:
        text += "\n\n```\n" + result["top_ops"] + "\n```"
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = scheduler_arg_parser("profile_step.py", __doc__, max_total_tokens=65536)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--torch-profile-rows", type=int, default=0,
                   help="print this many top ops of one more step from torch.profiler (default: off)")
    p.add_argument("--seed", type=int, default=0)
    return parse_scheduler_args(p, argv)


def scheduler_arg_parser(prog: str, doc: str | None, max_total_tokens: int) -> argparse.ArgumentParser:
    """The options of an in-process Scheduler (make_scheduler), shared by the profilers."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="model folder (default: made with --model-size)")
    p.add_argument("--model-size", choices=sorted(common.MODEL_SHAPES), default="tiny",
                   help="random Qwen2-shaped model when no --model-path (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--max-total-tokens", type=int, default=max_total_tokens)
    p.add_argument("--server-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="a ServerArgs field, e.g. page_size=16 (repeatable)")
    common.add_output_dir_arg(p)
    return p


def parse_scheduler_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.model_path is None:
        args.model_path = str(common.make_qwen2_model(args.model_size))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with common.LoadMonitor() as load:
        result = profile(args)
    common.write_results(f"{NAME}_bs{args.batch_size}", args.output_dir, result, table_of(result), load.summary())
    return result


if __name__ == "__main__":
    main()
