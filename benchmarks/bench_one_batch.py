"""Prefill and decode latency of one static batch, without the server or the scheduler.

For each batch size it takes fresh req rows and KV slots, prefills `--input-len` random tokens
per request in one EXTEND pass, then runs `--decode-steps` DECODE passes (greedy next token),
and reports the median step latency. It also measures this machine's memory copy bandwidth and
compares batch-1 decode with the roofline: at batch 1 a decode step must read every weight
once, so tokens/s cannot beat bandwidth / weight bytes. The roofline uses the copy's read+write
bytes per second (STREAM's convention); the fractions against the bytes copied per second, a pure
read stream and a model-dtype matvec are printed beside it, since they differ by up to 2x.

    python benchmarks/bench_one_batch.py                       # 0.5B Qwen2-shaped bf16, bs 1 8 32 64
    python benchmarks/bench_one_batch.py --model-size tiny --batch-sizes 1 4 --decode-steps 4
    python benchmarks/bench_one_batch.py --model-path ./my-model --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

NAME = "bench_one_batch"


# ----------------------------------------------------------------- bandwidth
def _best_time(fn, repeats: int) -> float:
    fn()                                            # fault pages in, pick kernels
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_and_read_s(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> tuple[float, float]:
    return _best_time(lambda: dst.copy_(src), repeats), _best_time(lambda: src.max(), repeats)


def measure_bandwidth(num_bytes: int = 256 << 20, hidden: int = 896, dtype: torch.dtype = torch.bfloat16,
                      repeats: int = 8) -> dict[str, float]:
    """Best-of-`repeats` memory bandwidths on buffers much larger than the caches.

    read_write_gbps  `dst.copy_(src)`: bytes read + bytes written (STREAM's convention), the roofline's
    copy_gbps        the same copy, counting the buffer once
    read_gbps        `src.max()`: a pure read stream
    gemv_gbps        weight bytes / time of one [num_bytes / hidden, hidden] x [hidden] matvec in the
                     model dtype through F.linear: what a plain matmul streams at batch 1

    Copy and read are measured on ordinary (4 KiB page) memory and on a 2 MiB-page arena (where
    the packed weights live, runtime/layers/packed_linear.py) and the faster of the two is kept, so
    the roofline is the strictest this machine shows; `*_4k_gbps` keep the ordinary-memory figures.
    main() measures before and after the batches and keeps the higher of each.
    """
    from radixlm.runtime.mem_cache.huge_pages import huge_page_empty

    out: dict[str, float] = {"buffer_mib": num_bytes / 2**20}
    for tag, make in (("_4k", lambda: torch.empty(num_bytes // 4, dtype=torch.float32)),
                      ("", lambda: huge_page_empty(num_bytes // 4, torch.float32))):
        copy_s, read_s = _copy_and_read_s(make().fill_(1.0), make(), repeats)
        out[f"copy{tag}_gbps"] = num_bytes / copy_s / 1e9
        out[f"read_write{tag}_gbps"] = 2 * num_bytes / copy_s / 1e9
        out[f"read{tag}_gbps"] = num_bytes / read_s / 1e9
    for key in ("copy", "read_write", "read"):
        out[f"{key}_gbps"] = max(out[f"{key}_gbps"], out[f"{key}_4k_gbps"])
    elem = torch.tensor([], dtype=dtype).element_size()
    w = torch.ones(num_bytes // elem // hidden, hidden, dtype=dtype)
    x = torch.ones(1, hidden, dtype=dtype)
    gemv_s = _best_time(lambda: torch.nn.functional.linear(x, w), repeats)
    out["gemv_gbps"] = w.numel() * elem / gemv_s / 1e9
    return out


# ----------------------------------------------------------------- one batch
class CopyProbe:
    """Times a 64 MiB copy in 2 MiB pages: the read+write bandwidth at this moment (best of two
    after a warm-up copy, so that one preempted copy does not count)."""

    def __init__(self, num_bytes: int = 64 << 20):
        from radixlm.runtime.mem_cache.huge_pages import huge_page_empty

        self.num_bytes = num_bytes
        self.src = huge_page_empty(num_bytes // 4, torch.float32).fill_(1.0)
        self.dst = huge_page_empty(num_bytes // 4, torch.float32).fill_(0.0)

    def __call__(self) -> float:
        return 2 * self.num_bytes / _best_time(lambda: self.dst.copy_(self.src), 2) / 1e9


def run_batch(runner: Any, batch_size: int, input_len: int, decode_steps: int, seed: int,
              probe: CopyProbe | None = None) -> dict[str, Any]:
    """Prefill + decode one static batch; frees every row and slot it took before returning.
    With `probe`, the copy bandwidth is measured after every decode step (outside its timing)."""
    from radixlm.runtime.mem_cache.kv_manager import KVManager
    from radixlm.runtime.model_executor.forward_batch import ForwardMode

    gen = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    prompts = torch.randint(3, vocab, (batch_size, input_len), generator=gen).tolist()
    kv = KVManager(runner.num_pages, runner.page_size, runner.max_running_requests, runner.context_len,
                   runner.device, disable_radix_cache=True)
    reqs = [_BenchReq(p) for p in prompts]
    if not all(kv.admit(req, kv.match_prefix([])) for req in reqs):
        raise RuntimeError(f"batch size {batch_size} exceeds max_running_requests")
    rows = [req.req_pool_idx for req in reqs]
    try:
        # prefill: tokens [0, input_len) of every request
        loc = _alloc(kv, reqs, input_len)
        fb = runner.make_forward_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows,
                                       [0] * batch_size, [input_len] * batch_size, loc, kv.req_to_token_pool)
        t0 = time.perf_counter()
        out = runner.forward(fb)
        prefill_s = time.perf_counter() - t0
        next_ids = out.next_token_logits.argmax(-1).tolist()
        step_times, step_gbps = [], []
        seq = input_len
        for _ in range(decode_steps):
            # decode: token [seq, seq + 1) of every request
            loc = _alloc(kv, reqs, 1)
            fb = runner.make_forward_batch(ForwardMode.DECODE, next_ids, rows, [seq] * batch_size,
                                           [seq + 1] * batch_size, loc, kv.req_to_token_pool)
            t0 = time.perf_counter()
            out = runner.forward(fb)
            next_ids = out.next_token_logits.argmax(-1).tolist()
            step_times.append(time.perf_counter() - t0)
            seq += 1
            if probe is not None:
                step_gbps.append(probe())
    finally:
        for req in reqs:
            kv.cache_finished_req(req)
    result = _batch_result(batch_size, input_len, prefill_s, step_times)
    if probe is not None:
        result["step_s"], result["copy_gbps_after_step"] = step_times, step_gbps
    return result


@dataclass(eq=False)
class _BenchReq:
    """The fields KVManager reads and writes (radixlm.runtime.mem_cache.kv_manager.KVReq)."""

    all_ids: list[int]
    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None


def _alloc(kv: Any, reqs: list[_BenchReq], n: int) -> torch.Tensor:
    """Slots for the next `n` tokens of every request (written into their rows by the KV manager)."""
    loc = kv.alloc_extend(reqs, [n] * len(reqs))
    if loc is None:
        raise RuntimeError("KV pool too small for this batch; raise --max-total-tokens")
    for req in reqs:
        req.kv_committed_len += n
    return loc


def _batch_result(bs: int, input_len: int, prefill_s: float, steps: list[float]) -> dict[str, Any]:
    # the first decode steps can include one-time work (allocator growth, oneDNN primitive
    # creation); the median is robust to that, `best` shows the floor
    median = statistics.median(steps) if steps else None
    return {
        "batch_size": bs, "input_len": input_len, "prefill_s": prefill_s,
        "prefill_tok_s": bs * input_len / prefill_s,
        "decode_steps": len(steps), "decode_step_median_ms": median * 1e3 if median else None,
        "decode_step_best_ms": min(steps) * 1e3 if steps else None,
        "decode_tok_s": bs / median if median else None,
        "decode_tok_s_best": bs / min(steps) if steps else None,
    }


# ----------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_one_batch.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(p)
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float32", "float16"),
                   help="weight dtype (default: %(default)s)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64], help="(default: %(default)s)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="untimed batch-1 prefill+decode steps first (default: %(default)s)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=1, help="KV page size (default: %(default)s)")
    p.add_argument("--bandwidth-mib", type=int, default=256,
                   help="buffer size of the copy-bandwidth measurement (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    common.add_output_dir_arg(p)
    return p.parse_args(argv)


def make_runner(args: argparse.Namespace, model_path: str) -> Any:
    from radixlm.runtime.model_executor.model_runner import ModelRunner
    from radixlm.runtime.server_args import ServerArgs

    bs = max(args.batch_sizes)
    need = bs * (args.input_len + args.decode_steps + args.page_size) + 64 * args.page_size
    server_args = ServerArgs.from_kwargs(
        model_path=model_path, device="cpu", dtype=args.dtype, max_total_tokens=need,
        max_running_requests=bs, page_size=args.page_size,
        context_length=args.input_len + args.decode_steps + 16).resolved()
    return ModelRunner(server_args)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except that a layer with a
    prepacked weight (runtime/layers/packed_linear.py) reads the packed copy instead, and a tied
    embedding table whose LM head is packed is read one row at a time (not counted)."""
    sizes = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    total = 0
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if packed is not None:
            total += packed.numel() * packed.element_size()
            sizes.pop(id(module.weight), None)
    return total + sum(sizes.values())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.model_path or common.make_qwen2_model(args.model_size, args.vocab_size)
    runner = make_runner(args, model_path)
    measure = lambda: measure_bandwidth(args.bandwidth_mib << 20, runner.model_config.hidden_size, runner.dtype)  # noqa: E731
    before = measure()
    weight_bytes = decode_weight_bytes(runner.model)
    if args.warmup_steps:
        run_batch(runner, 1, min(args.input_len, 32), args.warmup_steps, args.seed)
    rows = []
    with common.LoadMonitor() as load:
        for bs in tqdm(args.batch_sizes, desc="batch sizes", unit="batch"):
            probe = CopyProbe() if bs == 1 else None
            rows.append(run_batch(runner, bs, args.input_len, args.decode_steps, args.seed + bs, probe))
    # this VM's bandwidth drifts with its neighbours: measured before and after, the higher counts
    after = measure()
    bandwidth = {k: max(before[k], after[k]) for k in before}
    roofline_tok_s = bandwidth["read_write_gbps"] * 1e9 / weight_bytes
    batch1 = next((r for r in rows if r["batch_size"] == 1), None)
    results = {
        "model_path": model_path, "dtype": str(runner.dtype), "weight_bytes": weight_bytes,
        "num_params": sum(p.numel() for p in runner.model.parameters()),
        "bandwidth": bandwidth, "roofline_batch1_tok_s": roofline_tok_s,
        "roofline_step_ms": weight_bytes / (bandwidth["read_write_gbps"] * 1e9) * 1e3,
        "batch1_fraction_of_roofline": batch1["decode_tok_s"] / roofline_tok_s if batch1 else None,
        "batch1_best_fraction_of_roofline": batch1["decode_tok_s_best"] / roofline_tok_s if batch1 else None,
        "batch1_fraction_by_bandwidth": {k: batch1["decode_tok_s"] * weight_bytes / (bandwidth[k] * 1e9)
                                         for k in ("read_write_gbps", "copy_gbps", "read_gbps", "gemv_gbps")}
        if batch1 else None,
        "batch1_fraction_same_moment": _same_moment_fraction(batch1, weight_bytes) if batch1 else None,
        "threads": args.threads, "rows": rows,
    }
    write_results(results, args, load.summary())
    return results


def _same_moment_fraction(row: dict[str, Any], weight_bytes: int) -> dict[str, float]:
    """Each step against the copy bandwidth measured right after it: the VM's bandwidth drifts by up
    to 1.5x within minutes, so a roofline measured before and after the batches can belong to
    another moment. Returns the median fraction and the median bandwidth."""
    fractions = [weight_bytes / (gbps * 1e9) / s for s, gbps in zip(row["step_s"], row["copy_gbps_after_step"])]
    return {"median": statistics.median(fractions), "median_read_write_gbps": statistics.median(row["copy_gbps_after_step"])}


def write_results(results: dict[str, Any], args: argparse.Namespace, load: dict[str, Any]) -> None:
    headers = ["batch", "input", "prefill s", "prefill tok/s", "decode step ms (median)", "decode tok/s",
               "decode tok/s (best step)"]
    table_rows = [[r["batch_size"], r["input_len"], r["prefill_s"], r["prefill_tok_s"],
                   r["decode_step_median_ms"], r["decode_tok_s"], r["decode_tok_s_best"]] for r in results["rows"]]
    bw = results["bandwidth"]
    table = common.markdown_table(headers, table_rows)
    table += (f"\n\nWeights: {results['weight_bytes'] / 1e6:,.1f} MB ({results['dtype']}). "
              f"Copy bandwidth: {bw['read_write_gbps']:.1f} GB/s read+write ({bw['copy_gbps']:.1f} GB/s copied; "
              f"the better of 2 MiB pages and 4 KiB pages, which gave {bw['read_write_4k_gbps']:.1f}). "
              f"Roofline at batch 1: {results['roofline_step_ms']:.1f} ms/step = "
              f"{results['roofline_batch1_tok_s']:.1f} tok/s.")
    if results["batch1_fraction_of_roofline"] is not None:
        by = results["batch1_fraction_by_bandwidth"]
        table += (f" Batch-1 decode reaches {results['batch1_fraction_of_roofline']:.0%} of it "
                  f"(best step: {results['batch1_best_fraction_of_roofline']:.0%}). Against other bandwidths: "
                  f"{by['copy_gbps']:.0%} of copied bytes/s ({bw['copy_gbps']:.1f} GB/s), "
                  f"{by['read_gbps']:.0%} of a pure read ({bw['read_gbps']:.1f} GB/s), "
                  f"{by['gemv_gbps']:.0%} of a {results['dtype'].removeprefix('torch.')} matvec "
                  f"({bw['gemv_gbps']:.1f} GB/s).")
        same = results["batch1_fraction_same_moment"]
        table += (f" Against a 64 MiB copy timed right after each step (median {same['median_read_write_gbps']:.1f} "
                  f"GB/s read+write): median {same['median']:.0%} of the roofline.")
    common.write_results(NAME, args.output_dir, results, table, load)


if __name__ == "__main__":
    main()
