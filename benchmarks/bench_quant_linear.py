"""kernels/cpu_quant's quantized linear vs the bf16 packed gemm (kernels/cpu_gemm), per shape and batch.

    python benchmarks/bench_quant_linear.py [--types Q4_0 Q4_1 Q8_0] [--batches 1 4 16 64 256]

Random weights quantized with the `gguf` package; each kernel is timed as its fastest single call
of --iters x --repeats, each call on the next of several copies of the weight (--stream-mib in all,
more than the last-level cache, so the weights come from memory as in a decode step). Prints a Markdown
table of milliseconds per call and quantized/bf16 ratios, with the CPU model and the load.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from radixlm.kernels.cpu_gemm import load_cpu_gemm
from radixlm.kernels.cpu_quant import load_cpu_quant

SHAPES = {"tinyllama gate/up 2048->5632": (5632, 2048), "tinyllama down 5632->2048": (2048, 5632),
          "smollm2 gate/up 576->1536": (1536, 576), "smollm2 down 1536->576": (576, 1536)}


def copies(t: torch.Tensor, total_mib: int) -> list[torch.Tensor]:
    count = max(2, total_mib * 2**20 // (t.numel() * t.element_size()))
    return [t.clone() for _ in range(count)]


def cycle(weights: list[torch.Tensor], call):
    """A no-argument function that runs `call` on the next weight copy each time."""
    state = {"i": 0}

    def step():
        state["i"] = (state["i"] + 1) % len(weights)
        return call(weights[state["i"]])
    return step


def best_ms(fn, iters: int, repeats: int) -> float:
    """The fastest single call of iters * repeats (on a shared machine a preempted call only
    makes some calls slower, so the minimum is the figure that compares kernels)."""
    fn()
    times = []
    for _ in range(iters * repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def cpu_model() -> str:
    from radixlm.kernels.cpu_build import cpu_model_name

    return cpu_model_name()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--stream-mib", type=int, default=256, help="bytes of weight copies cycled through")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quant, gemm = load_cpu_quant(), load_cpu_gemm()
    assert quant is not None and gemm is not None, "needs AVX512-VNNI and AVX512-BF16"
    print(f"CPU: {cpu_model()}, threads {torch.get_num_threads()}, load {os.getloadavg()}")
    print("| shape | M | bf16 gemm ms | " + " | ".join(f"{t} ms (x bf16)" for t in args.types) + " |")
    print("|---|---|---|" + "---|" * len(args.types))
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = np.random.randn(n, k).astype(np.float32) * 0.05
        wb = torch.from_numpy(w).bfloat16()
        packed = torch.empty(gemm.packed_numel(n, k), dtype=torch.bfloat16)
        gemm.pack(wb, packed)
        bf16_copies = copies(packed, args.stream_mib)
        qweights = {}
        for name in args.types:
            t = GGMLQuantizationType[name]
            raw = torch.from_numpy(quants.quantize(w, t).reshape(-1).copy())
            out = torch.empty(quant.packed_bytes(int(t), n, k), dtype=torch.uint8)
            quant.repack(raw, int(t), n, k, out)
            qweights[name] = copies(out, args.stream_mib)
        for m in args.batches:
            x = torch.randn(m, k).bfloat16()
            iters = max(2, args.iters * 16 // max(m, 16))
            ref = best_ms(cycle(bf16_copies, lambda p, x=x, n=n: gemm.linear(x, p, n, None)), iters, args.repeats)
            cells = []
            for name in args.types:
                t = int(GGMLQuantizationType[name])
                ms = best_ms(cycle(qweights[name], lambda p, t=t, x=x, n=n: quant.linear(x, p, t, n)), iters, args.repeats)
                cells.append(f"{ms:.3f} ({ms / ref:.2f})")
            print(f"| {shape} | {m} | {ref:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
