"""A prepared CUDA check (< 5 minutes): FlashInfer vs torch_native attention, then greedy generation.

    python scripts/gpu_check.py                       # attention checks + tiny models
    python scripts/gpu_check.py --model-path DIR      # attention checks + that model
    python scripts/gpu_check.py --skip-model          # attention checks only

1. Attention: one random paged batch per case (extend with cached prefixes, mixed, decode;
   page_size 1 and 16; GQA groups 2 and 4; bf16 and fp16) run through the `flashinfer` backend,
   the `torch_native` backend and the metadata-driven `paged_attention_ref`. Also the metadata
   builders on CUDA in fp32 (reference vs torch_native, no FlashInfer needed).
2. Model: greedy generation driven step by step through `ModelRunner` (flashinfer, page_size 1 and
   16; torch_native too) compared with HF `generate` in the same dtype. A mismatch whose tokens were
   a near tie for HF (logit gap under --tie-tol, teacher-forced) counts as a pass, and says so.
   Without --model-path: the tiny test models (head_dim 16/32, which FlashInfer cannot run: those
   checks are SKIPs) plus a head_dim-64 copy of each architecture (`-d64`) for FlashInfer.

Prints one line per check (PASS / FAIL / SKIP, seconds: the first use of a FlashInfer kernel
includes its JIT build) and a summary; exits 0 when nothing failed, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cuda"   # module-level so the logic can be dry-run on CPU with the torch_native parts
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
EXTEND_LENS = [(0, 1), (0, 37), (16, 80), (32, 33), (5, 130), (64, 200)]
MIXED_LENS = [(48, 49), (17, 18), (0, 3), (64, 90), (1, 2)]
DECODE_LENS = [(s - 1, s) for s in (1, 9, 16, 17, 40, 64, 257)]


@dataclass
class Result:
    name: str
    status: str      # PASS, FAIL, or SKIP (a known limitation, not run)
    detail: str
    seconds: float = 0.0


def report(results: list[Result], res: Result) -> None:
    results.append(res)
    print(f"[{res.status}] {res.name}  ({res.seconds:.1f}s)  {res.detail}", flush=True)


def run_check(results: list[Result], name: str, fn, *args) -> None:
    """Runs one check; an exception is a failure whose first line is kept."""
    start = time.time()
    try:
        ok, detail = fn(*args)
    except Exception as exc:  # noqa: BLE001 - any error is a failed check, reported below
        ok, detail = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc(limit=3)
    report(results, Result(name, "PASS" if ok else "FAIL", detail, time.time() - start))


# ------------------------------------------------------------------ attention
def make_batch(lens, page_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, mode):
    """A ForwardBatch on CUDA over random paged KV (pages interleaved), this pass's K/V written."""
    from radixlm.runtime.mem_cache.kv_manager import write_slots
    from radixlm.runtime.mem_cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
    from radixlm.runtime.model_executor.forward_batch import ForwardBatch
    from radixlm.runtime.utils import ceil_div

    gen = torch.Generator().manual_seed(1234 + page_size)
    num_pages = 2 * sum(ceil_div(s, page_size) for _, s in lens) + 8
    alloc = TokenToKVPoolAllocator(num_pages, page_size)
    kv = KVCache(num_pages, page_size, 1, kv_heads, head_dim, dtype, DEVICE)
    pool = ReqToTokenPool(len(lens) + 1, max(s for _, s in lens) + 1, DEVICE)
    rows, last_locs = [pool.alloc() for _ in lens], []
    for i, (row, (p, _)) in enumerate(zip(rows, lens, strict=True)):
        alloc.alloc(1 + (i * 7) % (2 * page_size))          # a gap, so pages are not contiguous
        slots = alloc.alloc(p) if p else torch.zeros(1, dtype=torch.int64)
        write_slots(pool.req_to_token, [row], [0], [p], slots.to(DEVICE))
        last_locs.append(int(slots[-1]))
    prefix_lens, seq_lens = [p for p, _ in lens], [s for _, s in lens]
    out_loc = alloc.alloc_extend(prefix_lens, seq_lens, last_locs)
    write_slots(pool.req_to_token, rows, prefix_lens, seq_lens, out_loc.to(DEVICE))
    fb = ForwardBatch.build(mode, [0] * int(out_loc.numel()), rows, prefix_lens, seq_lens, out_loc,
                            pool, kv, DEVICE)
    for buf in (kv.k_buffer[0], kv.v_buffer[0]):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    n = fb.num_tokens
    q, k, v = (torch.randn(n, h, head_dim, generator=gen).to(DEVICE, dtype) for h in (heads, kv_heads, kv_heads))
    kv.set_kv(0, fb.out_cache_loc, k, v)
    return fb, q, k, v


def run_backend(name: str, fb, q, k, v, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    from radixlm.runtime.layers.attention.base import RadixAttention, create_backend

    backend = create_backend(name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             page_size=fb.kv_cache.page_size, device=DEVICE, dtype=q.dtype)
    backend.init_forward_metadata(fb)
    fb.attn_backend = backend
    layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5)
    return layer(q, k, v, fb).view(-1, heads, head_dim).float()


def reference(fb, q: torch.Tensor, head_dim: int) -> torch.Tensor:
    from radixlm.kernels.flashinfer_meta import build_paged_meta, paged_kv_view
    from radixlm.kernels.paged_attention_ref import paged_attention_ref

    P = fb.kv_cache.page_size
    m = build_paged_meta(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.prefix_lens,
                         fb.seq_lens, P)
    kp, vp = (paged_kv_view(b[0], P).float() for b in (fb.kv_cache.k_buffer, fb.kv_cache.v_buffer))
    return paged_attention_ref(q.float(), kp, vp, m.qo_indptr, m.kv_indptr, m.kv_indices,
                               m.kv_last_page_len, head_dim ** -0.5)


def check_attention(backend: str, mode_name: str, page_size: int, dtype: torch.dtype, heads: int,
                    kv_heads: int, head_dim: int) -> tuple[bool, str]:
    from radixlm.runtime.model_executor.forward_batch import ForwardMode

    mode = ForwardMode.DECODE if mode_name == "DECODE" else ForwardMode.EXTEND   # MIXED: an extend batch
    lens = {"EXTEND": EXTEND_LENS, "MIXED": MIXED_LENS, "DECODE": DECODE_LENS}[mode_name]
    fb, q, k, v = make_batch(lens, page_size, heads, kv_heads, head_dim, dtype, mode)
    native = run_backend("torch_native", fb, q, k, v, heads, kv_heads, head_dim)
    ref = reference(fb, q, head_dim)
    if backend == "torch_native":
        diff = (native - ref).abs().max().item()
        return diff <= TOL[dtype], f"max|native-ref|={diff:.2e} tol={TOL[dtype]:.0e}"
    out = run_backend(backend, fb, q, k, v, heads, kv_heads, head_dim)
    d_native = (out - native).abs().max().item()
    d_ref = (out - ref).abs().max().item()
    ok = max(d_native, d_ref) <= TOL[dtype]
    return ok, f"max|fi-native|={d_native:.2e} max|fi-ref|={d_ref:.2e} tol={TOL[dtype]:.0e}"


def attention_checks(results: list[Result], dtypes: list[str], head_dim: int) -> None:
    for P in (1, 16):
        for mode in ("EXTEND", "MIXED", "DECODE"):
            run_check(results, f"meta-on-cuda fp32 {mode} P={P}", check_attention,
                      "torch_native", mode, P, torch.float32, 8, 2, 64)
    if importlib.util.find_spec("flashinfer") is None:
        report(results, Result("flashinfer import", "FAIL", "flashinfer is not installed "
                               "(pip install flashinfer-python)"))
        return
    for dtype_name in dtypes:
        for P in (1, 16):
            for mode in ("EXTEND", "MIXED", "DECODE"):
                for heads, kv_heads in ((8, 2), (8, 4)):
                    run_check(results, f"flashinfer {dtype_name} {mode} P={P} H={heads}/{kv_heads} "
                              f"D={head_dim}", check_attention, "flashinfer", mode, P,
                              DTYPES[dtype_name], heads, kv_heads, head_dim)


# ---------------------------------------------------------------------- model
def runner_greedy(model_path: str, backend: str, page_size: int, dtype: str, prompts: list[list[int]],
                  n_new: int, **overrides) -> list[list[int]]:
    """Greedy tokens driven step by step through ModelRunner (one prefill, then decodes);
    `overrides` are more ServerArgs fields (e.g. disable_cuda_graph)."""
    from radixlm.runtime.managers.req import Req
    from radixlm.runtime.mem_cache.kv_manager import KVManager
    from radixlm.runtime.model_executor.forward_batch import ForwardMode
    from radixlm.runtime.model_executor.model_runner import ModelRunner
    from radixlm.runtime.sampling_params import SamplingParams
    from radixlm.runtime.server_args import ServerArgs

    args = ServerArgs(model_path=model_path, device=DEVICE, dtype=dtype, attention_backend=backend,
                      page_size=page_size, max_total_tokens=8192, max_running_requests=16,
                      **overrides).resolved()
    runner = ModelRunner(args)
    kv = KVManager(runner.num_pages, runner.page_size, runner.max_running_requests, runner.context_len,
                   runner.device, disable_radix_cache=True)
    reqs = [Req(rid=str(i), origin_input_ids=p, sampling_params=SamplingParams()) for i, p in enumerate(prompts)]
    for req in reqs:
        assert kv.admit(req, kv.match_prefix([]))
    rows = [req.req_pool_idx for req in reqs]
    lens = [len(p) for p in prompts]
    loc = kv.alloc_extend(reqs, lens)
    fb = runner.make_forward_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows, [0] * len(reqs),
                                   lens, loc, kv.req_to_token_pool)
    next_ids = runner.forward(fb).next_token_logits.argmax(-1).tolist()
    kv.commit(reqs, lens)                                # as the scheduler does after each pass
    for _ in range(n_new - 1):
        for req, t in zip(reqs, next_ids, strict=True):
            req.output_ids.append(t)
        prefix = [req.kv_committed_len for req in reqs]
        loc = kv.alloc_extend(reqs, [1] * len(reqs))
        fb = runner.make_forward_batch(ForwardMode.DECODE, next_ids, rows, prefix, [n + 1 for n in prefix], loc,
                                       kv.req_to_token_pool)
        next_ids = runner.forward(fb).next_token_logits.argmax(-1).tolist()
        kv.commit(reqs, [1] * len(reqs))
    return [req.output_ids + [t] for req, t in zip(reqs, next_ids, strict=True)]


def hf_generate(model, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False)
        outs.append(gen[0, len(p):].tolist())
    return outs


@torch.inference_mode()
def compare_greedy(model, prompts, ours, theirs, tie_tol: float) -> tuple[bool, str]:
    """Exact match over HF's length (HF stops at eos), or a first divergence that is a near tie."""
    notes = []
    for p, a, b in zip(prompts, ours, theirs, strict=True):
        a = a[:len(b)]
        if a == b:
            continue
        t = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        logits = model(torch.tensor([p + b[:t]], device=DEVICE)).logits[0, -1].float()
        gap = (logits[b[t]] - logits[a[t]]).item()
        if gap > tie_tol:
            return False, f"prompt len {len(p)}: diverges at token {t} (hf {b[t]} vs ours {a[t]}, gap {gap:.3f})"
        notes.append(f"near tie at {t} (gap {gap:.3f})")
    return True, "identical" if not notes else "; ".join(notes)


def check_greedy(hf, path: str, backend: str, page_size: int, dtype: str, prompts: list[list[int]],
                 theirs: list[list[int]], tie_tol: float) -> tuple[bool, str]:
    n_new = max(len(t) for t in theirs)
    ours = runner_greedy(path, backend, page_size, dtype, prompts, n_new)
    return compare_greedy(hf, prompts, ours, theirs, tie_tol)


def model_checks(results: list[Result], model_paths: dict[str, str], dtype: str, n_new: int,
                 tie_tol: float) -> None:
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.layers.attention.flashinfer_backend import flashinfer_unsupported_reason

    for name, path in model_paths.items():
        cfg = json.loads((Path(path) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, cfg["vocab_size"], (n,), generator=gen).tolist() for n in (5, 23, 61)]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(DEVICE).eval()
        theirs = hf_generate(hf, prompts, n_new)
        for backend, P in (("flashinfer", 1), ("flashinfer", 16), ("torch_native", 16)):
            check_name = f"greedy {name} {backend} {dtype} P={P}"
            why = flashinfer_unsupported_reason(head_dim, DTYPES[dtype]) if backend == "flashinfer" else None
            if why:
                report(results, Result(check_name, "SKIP", why))
                continue
            run_check(results, check_name, check_greedy, hf, path, backend, P, dtype, prompts, theirs, tie_tol)
        del hf
        torch.cuda.empty_cache()


def tiny_model_paths(out_dir: str) -> dict[str, str]:
    """The tiny test models (head_dim 16/32: FlashInfer cannot run them) plus a `-d64` copy of each
    architecture with head_dim 64, so the FlashInfer path runs real models too."""
    spec = importlib.util.spec_from_file_location("make_tiny_models", REPO / "scripts" / "make_tiny_models.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    paths = tiny.build_all(out_dir)
    base = json.loads((Path(paths["llama"]) / "config.json").read_text())
    specs = tiny.model_specs(base["vocab_size"], base["eos_token_id"], base["pad_token_id"])
    for seed, (name, config) in enumerate(specs.items()):
        config.hidden_size, config.head_dim, config.intermediate_size = 64 * config.num_attention_heads, 64, 256
        folder = Path(out_dir) / f"{name}-d64"
        folder.mkdir(parents=True, exist_ok=True)
        tiny.build_model(name, config, 100 + seed, folder, Path(out_dir) / "tokenizer")
        paths[f"{name}-d64"] = str(folder)
    return paths


# ----------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model-path", default=None, help="HF model folder for the generation check "
                        "(default: build the tiny test models)")
    parser.add_argument("--skip-model", action="store_true", help="attention checks only")
    parser.add_argument("--dtypes", default="bfloat16,float16", help="attention check dtypes")
    parser.add_argument("--head-dim", type=int, default=64,
                        help="head_dim of the attention checks (64 shares JIT kernels with the -d64 models)")
    parser.add_argument("--model-dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--tie-tol", type=float, default=0.15,
                        help="HF logit gap under which a greedy divergence is a near tie")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("FAIL: CUDA not available (this check needs a CUDA GPU)", flush=True)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    start, results = time.time(), []
    attention_checks(results, [d for d in args.dtypes.split(",") if d], args.head_dim)
    if not args.skip_model:
        with tempfile.TemporaryDirectory(prefix="radixlm-gpu-check-") as tmp:
            paths = {"model": args.model_path} if args.model_path else tiny_model_paths(tmp)
            model_checks(results, paths, args.model_dtype, args.new_tokens, args.tie_tol)
    failed = [r for r in results if r.status == "FAIL"]
    passed = sum(r.status == "PASS" for r in results)
    print(f"\n=== {passed} passed, {len(failed)} failed, {len(results) - passed - len(failed)} skipped "
          f"in {time.time() - start:.0f}s ===")
    for r in failed:
        print(f"FAILED: {r.name}: {r.detail}")
    print("PASS" if not failed else "FAIL")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
