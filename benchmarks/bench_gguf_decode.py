"""Decode tok/s of a GGUF model kept quantized vs dequantized to bf16 (--disable-gguf-quant), and RSS.

Writes (once, cached in --work-dir) a random Llama GGUF in TinyLlama-1.1B's shape (hidden 2048,
22 layers, 32/4 heads, FFN 5632; SmolLM2's tokenizer, so the vocabulary is 49,152) in each --types
(Q4_0, Q8_0, Q4_K_M), with the `gguf` package: one random tensor per shape (and type), quantized once
and written for every layer (the bytes per step are what matter here). Q4_K_M types the tensors as
llama.cpp's Q4_K_M does: Q6_K for output.weight and for attn_v / ffn_down of the `use_more_bits`
layers (the first and last eighth and every third between), Q4_K for the rest (token_embd too); the
gguf package cannot quantize k-quants, so those tensors are random valid blocks (random codes and
6-bit scales, fp16 super-block scales for a weight std about 0.02). Then, per file and mode, a child process
loads it through ModelRunner and times decode steps at --batch-sizes with bench_one_batch's
run_batch, and reports the RSS after loading (file bytes + KV pool + fixed overhead). With
--prefill-lens, it also times one prefill of each length (batch 1, the best of --prefill-repeats; the
first run of each length is a warm-up): the TTFT of one such prompt, less HTTP and sampling, and
the process's CPU time per thread for it (on a shared machine the steadier of the two figures).

    python benchmarks/bench_gguf_decode.py [--types Q4_0 Q8_0 Q4_K_M] [--batch-sizes 1 16]
    python benchmarks/bench_gguf_decode.py --types Q4_0 Q4_K_M --batch-sizes --prefill-lens 256 1024 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPE = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "ffn": 5632}
K_BYTES = {"Q4_K": 144, "Q6_K": 210}
K_SCALES = {"Q4_K": ((0, 8e-5), (2, 6e-4)), "Q6_K": ((208, 1.5e-5),)}   # fp16 scale offsets, values


def random_kquant(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a k-quant (any bytes are valid codes and scales; fp16 ones set)."""
    raw = rng.integers(0, 256, size=(rows * cols // 256, K_BYTES[type_name]), dtype=np.uint8)
    for at, value in K_SCALES[type_name]:
        raw[:, at:at + 2] = (value * rng.uniform(0.5, 1.5, (raw.shape[0], 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def tensor_type(file_type: str, piece: str, layer: int) -> str:
    """The GGUF type of 2-D tensor `piece` (attn_v, ffn_down, output, ...) of layer `layer` in a file of `file_type`."""
    if file_type != "Q4_K_M":
        return file_type
    n = SHAPE["layers"]
    more_bits = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
    return "Q6_K" if piece == "output" or (piece in ("attn_v", "ffn_down") and more_bits) else "Q4_K"


def write_gguf(path: Path, type_name: str) -> None:
    import gguf

    from radixlm.runtime.models.resolve import fetch_known_model

    tok = gguf.GGUFReader(str(fetch_known_model("smollm2-135m-instruct")))
    vocab = len(tok.fields["tokenizer.ggml.tokens"].contents())
    h, f, hd = SHAPE["hidden"], SHAPE["ffn"], SHAPE["hidden"] // SHAPE["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(h)
    w.add_block_count(SHAPE["layers"])
    w.add_feed_forward_length(f)
    w.add_head_count(SHAPE["heads"])
    w.add_head_count_kv(SHAPE["kv_heads"])
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for name, field in tok.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub)
    rng = np.random.default_rng(0)

    def q(rows: int, cols: int, t: str) -> np.ndarray:
        if t in K_BYTES:
            return random_kquant(t, rows, cols, rng)
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.02).astype(np.float32),
                                    gguf.GGMLQuantizationType[t])

    shapes = {"attn_q": (h, h), "attn_k": (SHAPE["kv_heads"] * hd, h), "attn_v": (SHAPE["kv_heads"] * hd, h),
              "attn_output": (h, h), "ffn_gate": (f, h), "ffn_up": (f, h), "ffn_down": (h, f)}
    blocks: dict[tuple[str, str], np.ndarray] = {}      # (name, type) -> the one random tensor
    ones = np.ones(h, dtype=np.float32)
    embd = tensor_type(type_name, "token_embd", 0)
    w.add_tensor("token_embd.weight", q(vocab, h, embd), raw_dtype=gguf.GGMLQuantizationType[embd])
    if type_name == "Q4_K_M":        # an untied head (Q6_K), as TinyLlama's files have
        w.add_tensor("output.weight", q(vocab, h, "Q6_K"), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.add_tensor("output_norm.weight", ones)
    for i in range(SHAPE["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for name, shape in shapes.items():
            t = tensor_type(type_name, name, i)
            if (name, t) not in blocks:
                blocks[name, t] = q(*shape, t)
            w.add_tensor(f"blk.{i}.{name}.weight", blocks[name, t], raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS; RssAnon: heap and anonymous maps; RssFile: mapped files)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def child(args: argparse.Namespace) -> None:
    """One file, one mode: prints a JSON line with RSS, KV pool bytes and decode tok/s per batch size."""
    import torch
    from bench_one_batch import run_batch

    from radixlm.runtime.model_executor.model_runner import ModelRunner
    from radixlm.runtime.server_args import ServerArgs

    torch.set_num_threads(args.threads)
    bs = max(args.batch_sizes, default=1)
    longest = max(args.prefill_lens, default=0)
    need = max(bs * (args.input_len + args.decode_steps + 1), longest + 1) + 64
    sa = ServerArgs.from_kwargs(model_path=args.child, device="cpu", dtype="bfloat16", max_total_tokens=need,
                                max_running_requests=bs, page_size=1, disable_gguf_quant=args.dequantize,
                                context_length=max(args.input_len + args.decode_steps + 16, longest)).resolved()
    runner = ModelRunner(sa)
    kv = runner.kv_cache
    kv_bytes = sum(b.numel() * b.element_size() for b in (*kv.k_buffer, *kv.v_buffer))
    out = {"rss_mib_after_load": rss_mib(), "rss_anon_mib": rss_mib("RssAnon"), "rss_file_mib": rss_mib("RssFile"),
           "kv_pool_mib": kv_bytes / 2**20, "decode_tok_s": {}, "prefill_s": {}}
    run_batch(runner, 1, 16, 2, 0)
    for b in args.batch_sizes:
        r = run_batch(runner, b, args.input_len, args.decode_steps, b)
        out["decode_tok_s"][b] = r["decode_tok_s"]
    out["prefill_cpu_s"] = {}
    for n in args.prefill_lens:
        times, cpu = [], []
        for i in range(1 + args.prefill_repeats):
            c0 = time.process_time()
            times.append(run_batch(runner, 1, n, 0, i)["prefill_s"])
            cpu.append((time.process_time() - c0) / args.threads)
        out["prefill_s"][n] = min(times[1:])
        out["prefill_cpu_s"][n] = min(cpu[1:])
    out["rss_mib_end"] = rss_mib()
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"])
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 16])
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[], help="also time one prefill of each length")
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--modes", nargs="+", choices=["quantized", "dequantized"], default=["quantized", "dequantized"])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "radixlm-bench-gguf"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dequantize", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    with open("/proc/cpuinfo") as f:
        cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    print(f"CPU: {cpu}, threads {args.threads}, load {os.getloadavg()}")
    print("| file | MiB | mode | RSS after load MiB (anon + file) | KV pool MiB | " +
          "".join(f"decode tok/s bs {b} | " for b in args.batch_sizes) +
          "".join(f"prefill {n} s (tok/s); CPU s / thread | " for n in args.prefill_lens))
    print("|---|---|---|---|---|" + "---|" * (len(args.batch_sizes) + len(args.prefill_lens)))
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    for t in args.types:
        path = Path(args.work_dir) / f"tinyllama-shape-{t}.gguf"
        if not path.is_file():
            write_gguf(path, t)
        for dequantize in [m == "dequantized" for m in args.modes]:
            cmd = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads),
                   "--input-len", str(args.input_len), "--decode-steps", str(args.decode_steps),
                   "--batch-sizes", *map(str, args.batch_sizes), "--prefill-lens", *map(str, args.prefill_lens),
                   "--prefill-repeats", str(args.prefill_repeats), *(["--dequantize"] if dequantize else [])]
            text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            r = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:])
            rates = "".join(f"{r['decode_tok_s'][str(b)]:.2f} | " for b in args.batch_sizes)
            rates += "".join(f"{r['prefill_s'][str(n)]:.2f} ({n / r['prefill_s'][str(n)]:.0f}); "
                             f"{r['prefill_cpu_s'][str(n)]:.2f} | " for n in args.prefill_lens)
            print(f"| {path.name} | {path.stat().st_size / 2**20:.0f} | "
                  f"{'--disable-gguf-quant' if dequantize else 'quantized'} | {r['rss_mib_after_load']:.0f} "
                  f"({r['rss_anon_mib']:.0f} + {r['rss_file_mib']:.0f}) | "
                  f"{r['kv_pool_mib']:.0f} | {rates}", flush=True)
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
