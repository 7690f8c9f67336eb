"""Prefill-sized matmuls of GGUF weights kept quantized: the three kernels quant_select.py chooses among
(vnni: the decode kernel, gemm: kernels/cpu_quant/qgemm.h, dequant: bf16 tiles through oneDNN) against
oneDNN's packed bf16 matmul of a dense weight of the same shape, on TinyLlama-1.1B's layer shapes.

    python benchmarks/bench_quant_prefill.py [--type 2] [--rows 256 1024] [--threads 1] [--cpu-time]

Random weights: gguf-quantized Gaussians for the 32-block types, random valid blocks for the k-quants
(12 Q4_K, 13 Q5_K, 14 Q6_K). Each figure is the best of --repeats calls after a warm-up. --cpu-time
takes the process's CPU time per thread instead of wall time: on a shared machine a neighbour's
load then costs far less (cache sharing aside), which is what makes one-thread figures comparable.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

SHAPES = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
K_BYTES = {12: 144, 13: 176, 14: 210}
K_SCALES = {12: [0, 2], 13: [0, 2], 14: [208]}


def raw_weight(qtype: int, n: int, k: int) -> torch.Tensor:
    import gguf

    rng = np.random.default_rng(0)
    if qtype in K_BYTES:
        raw = rng.integers(0, 256, size=(n * k // 256, K_BYTES[qtype]), dtype=np.uint8)
        for at in K_SCALES[qtype]:
            raw[:, at:at + 2] = rng.uniform(1e-3, 1e-2, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(n, -1))
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype)).copy())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", type=int, default=2, help="ggml type number (2 Q4_0, 12 Q4_K, 14 Q6_K, ...)")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-time", action="store_true")
    args = p.parse_args()
    from radixlm.kernels.cpu_build import cpu_model_name
    from radixlm.runtime.layers import quant_linear as ql

    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    scale = args.threads if args.cpu_time else 1

    def best(fn) -> float:
        fn()
        out = float("inf")
        for _ in range(args.repeats):
            t0 = clock()
            fn()
            out = min(out, (clock() - t0) / scale)
        return out

    print(f"CPU: {cpu_model_name()}, threads {args.threads}, {'CPU' if args.cpu_time else 'wall'} time, "
          f"type {args.type}, load {os.getloadavg()}")
    kinds = ("vnni", "gemm", "dequant", "onednn bf16")
    print("| shape (out x in) | rows | " + " | ".join(f"{k} ms (GFLOP/s)" for k in kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    total = {(r, k): 0.0 for r in args.rows for k in kinds}
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            w = ql.quant_weight([(raw_weight(args.type, n, k), args.type, n)], k)
            part = w.parts[0]
            if not part.packed:
                raise SystemExit("kernels/cpu_quant is off on this CPU")
            dense = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), 1)
            for r in args.rows:
                x = torch.randn(r, k).bfloat16()
                calls = {kind: (lambda x=x, kind=kind, part=part, k=k: ql.part_linear(part, x, k, kind))
                         for kind in kinds[:3]}
                calls["onednn bf16"] = lambda x=x, d=dense: torch.ops.mkldnn._linear_pointwise(x, d, None, "none", [], "")
                times = {kind: best(call) for kind, call in calls.items()}
                flop = 2 * r * n * k
                for kind, t in times.items():
                    total[r, kind] += t
                print(f"| {name} {n} x {k} | {r} | " +
                      " | ".join(f"{times[kind] * 1e3:.1f} ({flop / times[kind] / 1e9:.0f})" for kind in kinds) + " |",
                      flush=True)
    for r in args.rows:
        print(f"| one layer | {r} | " + " | ".join(f"{total[r, kind] * 1e3:.1f}" for kind in kinds) + " |")
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
