"""The phases of scripts/gpu_check.sh, one process each (the shell enforces each deadline).

    python scripts/gpu_check_phases.py --list                       # "name deadline_s" per phase
    python scripts/gpu_check_phases.py --phase NAME --results DIR   # runs one, appends its line

Each phase appends one line to DIR/results.txt: `NAME PASS|FAIL|SKIP <seconds>s <detail>`.
Models are built once into DIR/models (tiny random models with head_dim 64; random Llamas in
SmolLM2-135M's and Qwen2-0.5B's shapes for decode speed); bf16 only, FlashInfer with backend fa2.
The serving and HTTP phases are in gpu_check_serving.py. The SmolLM2 GGUF (about 93 MB) does not
fit the 64 MiB that travels to the GPU machine, so SmolLM2's own weights are not checked there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

H200_BYTES_PER_S = 4.8e12     # HBM3e bandwidth of one H200, for the decode roofline


@dataclass(frozen=True)
class Phase:
    name: str
    deadline_s: int
    run: object               # (results_dir: Path) -> (ok | None for skip, detail)


def _results(checks: list) -> tuple[bool, str]:
    failed = [r for r in checks if r.status == "FAIL"]
    detail = f"{len(checks) - len(failed)}/{len(checks)} ok" + "".join(f"; FAIL {r.name}: {r.detail}" for r in failed)
    return not failed, detail


def phase_flashinfer_jit(_: Path) -> tuple[bool, str]:
    """Builds both FlashInfer modules every later phase uses, in parallel (one process each):
    GQA group 4 decodes through the prefill module (tensor cores), group 2 through the decode one."""
    import flashinfer

    code = ("import sys, torch; from gpu_check import check_attention; "
            "ok, d = check_attention('flashinfer', 'DECODE', 1, torch.bfloat16, 8, {kv}, 64); "
            "print(d); sys.exit(0 if ok else 1)")
    here = Path(__file__).resolve().parent
    procs = {kv: subprocess.Popen([sys.executable, "-c", code.format(kv=kv)], cwd=here, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for kv in (2, 4)}
    parts, ok = [], True
    for kv, proc in procs.items():
        out = proc.communicate()[0]
        print(out, flush=True)
        ok = ok and proc.returncode == 0
        module = "prefill module (tensor-core decode)" if kv == 2 else "decode module"
        parts.append(f"H=8/{kv} {module}: {out.strip().splitlines()[-1] if out.strip() else 'no output'}")
    return ok, f"flashinfer {flashinfer.__version__}, JIT + run: " + "; ".join(parts)


def phase_attention(_: Path) -> tuple[bool, str]:
    import gpu_check

    checks: list = []
    gpu_check.attention_checks(checks, ["bfloat16"], 64)      # ragged / prefix / mixed / decode, P 1 and 16
    return _results(checks)


def tiny_d64(results_dir: Path) -> dict[str, str]:
    """The head_dim-64 tiny models, built once under results_dir/models."""
    import gpu_check

    folder = results_dir / "models"
    done = folder / "DONE"
    if not done.exists():
        gpu_check.tiny_model_paths(str(folder))
        done.write_text("ok\n")
    return {n: str(folder / n) for n in ("llama-d64", "qwen2-d64", "qwen3-d64")}


def phase_greedy_hf(results_dir: Path) -> tuple[bool, str]:
    import gpu_check

    checks: list = []
    gpu_check.model_checks(checks, tiny_d64(results_dir), "bfloat16", 16, 0.15)
    ok, detail = _results(checks)
    return ok, detail + "; SmolLM2 weights not checked (GGUF ~93 MB does not travel)"


def phase_cuda_graphs(results_dir: Path) -> tuple[bool, str]:
    import torch
    from gpu_check import runner_greedy

    path = tiny_d64(results_dir)["llama-d64"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 23, 61)]   # bucket 4: 1 pad row
    notes = []
    for P in (1, 16):
        on = runner_greedy(path, "flashinfer", P, "bfloat16", prompts, 12)
        off = runner_greedy(path, "flashinfer", P, "bfloat16", prompts, 12, disable_cuda_graph=True)
        if on != off:
            return False, f"P={P}: graphs on {on} != off {off}"
        notes.append(f"P={P} identical")
    return True, ", ".join(notes)


def tiny_moe_d64(results_dir: Path) -> str:
    """A tiny random Qwen3-MoE (head_dim 64, 8 experts top-2, sizes multiples of 16 for the grouped
    matmul), built once beside the other tiny models with their tokenizer."""
    from make_tiny_models import build_model
    from transformers import Qwen3MoeConfig

    tiny_d64(results_dir)                                # the tokenizer folder
    folder = results_dir / "models" / "qwen3moe-d64"
    if not (folder / "config.json").exists():
        base = json.loads((results_dir / "models" / "llama" / "config.json").read_text())
        config = Qwen3MoeConfig(vocab_size=base["vocab_size"], eos_token_id=base["eos_token_id"],
                                pad_token_id=base["pad_token_id"], bos_token_id=base["pad_token_id"],
                                hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                norm_topk_prob=True, max_position_embeddings=2048, initializer_range=0.1,
                                tie_word_embeddings=False)
        folder.mkdir(parents=True, exist_ok=True)
        build_model("qwen3moe-d64", config, 11, folder, results_dir / "models" / "tokenizer")
    return str(folder)


def phase_moe(results_dir: Path) -> tuple[bool, str]:
    """MoE on CUDA: the grouped-matmul experts vs the torch loop (a random bf16 block), then a tiny
    Qwen3-MoE: greedy with CUDA graphs on == off, and against HF bf16 (near ties allowed)."""
    import gpu_check
    import torch
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.layers.moe import SparseMoeBlock
    from radixlm.runtime.layers.moe_grouped import grouped_mm_supported

    if not grouped_mm_supported(torch.device("cuda"), torch.bfloat16):
        return None, f"no grouped matmul on {torch.cuda.get_device_name()} (needs sm90+): the torch loop runs"
    torch.manual_seed(0)
    block = SparseMoeBlock(256, 8, 2, 128, True, 256).to("cuda", torch.bfloat16)
    for p in block.parameters():
        p.data.normal_(0, 0.1)
    notes = []
    for n in (1, 7, 64):
        x = torch.randn(n, 256, device="cuda", dtype=torch.bfloat16)
        want, got = block.forward_native(x).float(), block(x).float()
        err = (got - want).abs().max().item() / want.abs().max().item()
        if err > 2e-2:
            return False, f"grouped vs loop, n={n}: relative error {err:.3g}"
        notes.append(f"n={n} {err:.1e}")
    path = tiny_moe_d64(results_dir)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 23, 61)]
    on = gpu_check.runner_greedy(path, "flashinfer", 16, "bfloat16", prompts, 12)
    off = gpu_check.runner_greedy(path, "flashinfer", 16, "bfloat16", prompts, 12, disable_cuda_graph=True)
    if on != off:
        return False, f"graphs on {on} != off {off}"
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    ok, detail = gpu_check.compare_greedy(hf, prompts, on, gpu_check.hf_generate(hf, prompts, 12), 0.15)
    return ok, f"grouped vs loop {', '.join(notes)}; graphs on == off; vs HF: {detail}"


def phase_serving(results_dir: Path) -> tuple[bool, str]:
    from gpu_check_serving import phase_serving as serving

    return serving(tiny_d64(results_dir)["llama-d64"])


def phase_http(results_dir: Path) -> tuple[bool, str]:
    from gpu_check_serving import phase_http as http

    return http(tiny_d64(results_dir)["llama-d64"], results_dir / "http_server.log")


SHAPES = {   # random Llama-architecture models in the shapes of two served models
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}


def shaped_model(results_dir: Path, name: str) -> str:
    """A random bf16 Llama in one of SHAPES (initialised on the GPU: seconds, not minutes)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = results_dir / "models" / f"{name}-shaped"
    if not (folder / "config.json").exists():
        config = LlamaConfig(max_position_embeddings=8192, rope_theta=100000.0, initializer_range=0.1, **SHAPES[name])
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()
    return str(folder)


def decode_runner(path: str, max_bs: int = 64):
    """A ModelRunner (CUDA graphs up to max_bs) with KV room for max_bs requests of 256 tokens."""
    from gpu_check import DEVICE

    from radixlm.runtime.model_executor.model_runner import ModelRunner
    from radixlm.runtime.server_args import ServerArgs

    args = ServerArgs(model_path=path, device=DEVICE, dtype="bfloat16", max_total_tokens=max_bs * 256 + 512,
                      max_running_requests=max_bs, cuda_graph_max_bs=max_bs).resolved()
    return ModelRunner(args)


def decode_rate(runner, bs: int, steps: int = 32, prompt_len: int = 128) -> tuple[float, float, float]:
    """(tok/s, weight bytes, seconds of one bare graph replay) of greedy decode steps at batch bs
    through `runner` (a fresh KV table). The step time less the replay is the host's share."""
    import torch

    from radixlm.runtime.managers.req import Req
    from radixlm.runtime.mem_cache.kv_manager import KVManager
    from radixlm.runtime.model_executor.cuda_graph_runner import pick_bucket
    from radixlm.runtime.model_executor.forward_batch import ForwardMode
    from radixlm.runtime.sampling_params import SamplingParams

    kv = KVManager(runner.num_pages, 1, runner.max_running_requests, runner.context_len, runner.device, True)
    reqs = [Req(rid=str(i), origin_input_ids=[(7 * i + j) % 40000 + 3 for j in range(prompt_len)],
                sampling_params=SamplingParams()) for i in range(bs)]
    for req in reqs:
        assert kv.admit(req, kv.match_prefix([]))
    rows = [r.req_pool_idx for r in reqs]
    loc = kv.alloc_extend(reqs, [prompt_len] * bs)
    fb = runner.make_forward_batch(ForwardMode.EXTEND, [t for r in reqs for t in r.origin_input_ids], rows,
                                   [0] * bs, [prompt_len] * bs, loc, kv.req_to_token_pool)
    ids = runner.forward(fb).next_token_logits.argmax(-1).tolist()
    kv.commit(reqs, [prompt_len] * bs)
    start = 0.0
    for step in range(steps + 2):                     # 2 warm-up steps
        if step == 2:
            torch.cuda.synchronize()
            start = time.perf_counter()
        for req, t in zip(reqs, ids):
            req.output_ids.append(t)
        prefix = [r.kv_committed_len for r in reqs]
        loc = kv.alloc_extend(reqs, [1] * bs)
        fb = runner.make_forward_batch(ForwardMode.DECODE, ids, rows, prefix, [n + 1 for n in prefix], loc,
                                       kv.req_to_token_pool)
        ids = runner.forward(fb).next_token_logits.argmax(-1).tolist()
        kv.commit(reqs, [1] * bs)
    elapsed = time.perf_counter() - start
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    graph = runner.graph_runner.buckets[pick_bucket(runner.graph_runner.sizes, bs)].graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return bs * steps / elapsed, weight_bytes, (time.perf_counter() - t0) / 20


def profile_eager_decode(runner, bs: int = 1) -> str:
    """Kernels of one eager decode pass (what a graph replays), by CUDA time; table in the log."""
    import torch

    from radixlm.runtime.managers.req import Req
    from radixlm.runtime.mem_cache.kv_manager import KVManager
    from radixlm.runtime.model_executor.forward_batch import ForwardMode
    from radixlm.runtime.sampling_params import SamplingParams

    try:
        kv = KVManager(runner.num_pages, 1, runner.max_running_requests, runner.context_len, runner.device, True)
        reqs = [Req(rid=str(i), origin_input_ids=list(range(3, 67)), sampling_params=SamplingParams()) for i in range(bs)]
        for req in reqs:
            assert kv.admit(req, kv.match_prefix([]))
            req.output_ids.append(5)
        req_lens = [r.seq_len for r in reqs]
        loc = kv.alloc_extend(reqs, req_lens)
        rows = [r.req_pool_idx for r in reqs]
        fb = runner.make_forward_batch(ForwardMode.DECODE, [5] * bs, rows, [n - 1 for n in req_lens], req_lens,
                                       loc[-bs:], kv.req_to_token_pool)
        with torch.inference_mode():
            for _ in range(2):
                runner.attn_backend.init_forward_metadata(fb)
                runner.model(fb.input_ids, fb.positions, fb)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                runner.attn_backend.init_forward_metadata(fb)
                runner.model(fb.input_ids, fb.positions, fb)
                torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.device_time for e in events)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
        return f"eager decode bs={bs}: {len(events)} kernels, {busy_us / 1e3:.2f} ms of kernel time"
    except Exception as exc:  # noqa: BLE001 - a profile is information, never a failure
        return f"profile failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]


def phase_decode_tps(results_dir: Path) -> tuple[bool, str]:
    lines = []
    for name in SHAPES:
        runner = decode_runner(shaped_model(results_dir, name))
        parts = []
        for bs in (1, 16, 64):
            rate, weight_bytes, replay_s = decode_rate(runner, bs)
            step_s = bs / rate
            roofline = weight_bytes / H200_BYTES_PER_S
            parts.append(f"bs={bs}: {rate:.0f} tok/s ({step_s * 1e3:.2f} ms/step, of which graph replay "
                         f"{replay_s * 1e3:.2f} ms; weight-read roofline {roofline * 1e3:.3f} ms = "
                         f"{100 * roofline / step_s:.0f}% of the step, {100 * roofline / replay_s:.0f}% of the replay)")
        parts.append(profile_eager_decode(runner))
        lines.append(f"{name}-shaped bf16 ({weight_bytes / 2**20:.0f} MiB): " + ", ".join(parts))
    return True, "CUDA graphs on; " + "; ".join(lines)


PHASES = [
    Phase("flashinfer_jit", 150, phase_flashinfer_jit),
    Phase("attention", 45, phase_attention),
    Phase("greedy_hf", 45, phase_greedy_hf),
    Phase("cuda_graphs", 30, phase_cuda_graphs),
    Phase("moe", 30, phase_moe),
    Phase("serving", 45, phase_serving),
    Phase("http", 40, phase_http),
    Phase("decode_tps", 35, phase_decode_tps),
]


def run_phase(name: str, results_dir: Path) -> int:
    """Runs one phase and appends its line to results.txt; exit 0 unless it failed."""
    phase = next(p for p in PHASES if p.name == name)
    start = time.time()
    try:
        ok, detail = phase.run(results_dir)
    except Exception as exc:  # noqa: BLE001 - a phase error is a FAIL line, traceback in its log
        traceback.print_exc()
        ok, detail = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
    line = f"{name} {status} {time.time() - start:.0f}s {detail}"
    print(line, flush=True)
    with open(results_dir / "results.txt", "a") as f:
        f.write(line + "\n")
    return 1 if status == "FAIL" else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print 'name deadline_s' per phase")
    parser.add_argument("--phase", choices=[p.name for p in PHASES])
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    if args.list:
        for p in PHASES:
            print(p.name, p.deadline_s)
        return 0
    if not (args.phase and args.results):
        parser.error("--phase and --results are required (or --list)")
    args.results.mkdir(parents=True, exist_ok=True)
    return run_phase(args.phase, args.results)


if __name__ == "__main__":
    sys.exit(main())
