"""Micro-benchmark: CPU paged attention, C++ kernels vs the torch path of torch_native.

For each model shape, batch size and context length it builds a paged KV pool (pages handed out
in shuffled order, as after a while of serving), a decode batch (or, with --mode extend, a
prefill of --extend-len new tokens over the context), and times one forward pass's attention:
`init_forward_metadata` once, then every layer's attention over its own K/V buffers (so the
cache is not artificially warm). Reported per layer, best of --repeats. Machine load is recorded
(/proc/stat) because the machine may be shared: compare ratios within one run.

    python benchmarks/bench_attention.py --batch 1 16 64 --context 128 512 2048
    python benchmarks/bench_attention.py --mode extend --batch 1 4 --context 512 --extend-len 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from radixlm.runtime.layers.attention.base import RadixAttention
from radixlm.runtime.layers.attention.torch_native import TorchNativeAttnBackend
from radixlm.runtime.mem_cache.memory_pool import KVCache, ReqToTokenPool
from radixlm.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.utils import ceil_div

SHAPES = {  # name: (q heads, kv heads, head_dim)
    "smollm2-135m": (9, 3, 64),
    "qwen2-0.5b": (14, 2, 64),
}


def cpu_busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


def build(shape: tuple[int, int, int], bs: int, ctx: int, extend_len: int, layers: int, page_size: int,
          dtype: torch.dtype, seed: int = 0) -> tuple[ForwardBatch, torch.Tensor, list[RadixAttention]]:
    """A batch of `bs` requests with `ctx` cached tokens each plus `extend_len` new ones."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(seed)
    seq = ctx + extend_len
    pages_per_req = ceil_div(seq, page_size)
    num_pages = bs * pages_per_req
    kv = KVCache(num_pages, page_size, layers, kv_heads, head_dim, dtype, "cpu")
    for buf in kv.k_buffer + kv.v_buffer:
        buf.normal_(generator=gen)
    pool = ReqToTokenPool(bs, seq, "cpu")
    pages = (torch.randperm(num_pages, generator=gen) + 1).view(bs, pages_per_req)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).view(bs, -1)[:, :seq]
    pool.req_to_token[:, :seq] = slots.to(torch.int32)
    out_loc = slots[:, ctx:].reshape(-1)
    mode = ForwardMode.DECODE if extend_len == 1 else ForwardMode.EXTEND
    fb = ForwardBatch.build(mode, [0] * bs * extend_len, list(range(bs)), [ctx] * bs, [seq] * bs, out_loc,
                            pool, kv, "cpu")
    q = torch.randn(bs * extend_len, heads, head_dim, generator=gen).to(dtype)
    lays = [RadixAttention(i, heads, kv_heads, head_dim, head_dim ** -0.5) for i in range(layers)]
    return fb, q, lays


def time_pass(backend: TorchNativeAttnBackend, fb: ForwardBatch, q: torch.Tensor, layers: list[RadixAttention],
              repeats: int, clock=time.perf_counter) -> float:
    """Best-of-`repeats` seconds per layer for one pass (metadata + every layer's attention)."""
    fb.attn_backend = backend
    best = float("inf")
    for _ in range(repeats + 1):                 # +1: warm-up
        t0 = clock()
        backend.init_forward_metadata(fb)
        for layer in layers:
            if fb.forward_mode.is_decode:
                backend.forward_decode(q, layer, fb)
            else:
                backend.forward_extend(q, layer, fb)
        best = min(best, clock() - t0)
    return best / len(layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--context", nargs="+", type=int, default=[128, 512, 2048])
    ap.add_argument("--mode", choices=["decode", "extend"], default="decode")
    ap.add_argument("--extend-len", type=int, default=128, help="new tokens per request with --mode extend")
    ap.add_argument("--layers", type=int, default=4, help="layers per pass, each with its own K/V buffers")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (steadier on a shared machine; use with --threads 1)")
    ap.add_argument("--output", help="write JSON results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = TorchNativeAttnBackend()
    if kernel.kernels is None:
        print("CPU attention kernels unavailable; nothing to compare", file=sys.stderr)
        return 1
    torch_path = TorchNativeAttnBackend(use_kernels=False)
    dtype = getattr(torch, args.dtype)
    extend_len = 1 if args.mode == "decode" else args.extend_len
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    busy0 = cpu_busy()
    rows = []
    print(f"# {args.mode}, {args.dtype}, page_size {args.page_size}, {torch.get_num_threads()} threads, "
          f"ISA {kernel.kernels.isa()}; {args.clock} ms per layer (best of {args.repeats})")
    print(f"{'shape':<14} {'batch':>5} {'context':>7} {'torch ms':>9} {'kernel ms':>9} {'speedup':>8}")
    for name in args.shapes:
        for bs in args.batch:
            for ctx in args.context:
                fb, q, layers = build(SHAPES[name], bs, ctx, extend_len, args.layers, args.page_size, dtype)
                t_torch = time_pass(torch_path, fb, q, layers, args.repeats, clock)
                t_kernel = time_pass(kernel, fb, q, layers, args.repeats, clock)
                rows.append({"shape": name, "batch": bs, "context": ctx, "torch_ms": t_torch * 1e3,
                             "kernel_ms": t_kernel * 1e3, "speedup": t_torch / t_kernel})
                print(f"{name:<14} {bs:>5} {ctx:>7} {t_torch * 1e3:>9.3f} {t_kernel * 1e3:>9.3f} "
                      f"{t_torch / t_kernel:>7.2f}x", flush=True)
                del fb, q
    busy1 = cpu_busy()
    load = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    print(f"# machine busy fraction during the run: {load:.2f} (all processes, all cores)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "machine_busy": load, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
