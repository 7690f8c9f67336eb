"""MoE decode cost: a random Qwen3-MoE-shaped model beside a dense Qwen3 with the same active parameters.

A MoE decode step should cost close to a dense step with the same *active* parameters (top-k
experts per token), not the total. This builds (once, cached like common_models) two random bf16
models with one shape apart from the MLP:

    moe     Qwen3-MoE: --experts experts of --expert-size, top --top-k, every layer sparse
    dense   Qwen3: intermediate_size = top_k * expert_size (the same active MLP parameters)

and reports decode tok/s at each --batch-sizes for radixlm on both (ModelRunner, prefill then
greedy decode steps, as bench_one_batch.py does) and for HF transformers on the MoE model
(`generate`, decode time = generate(1 + steps) - generate(1), each the fastest of 3, divided by steps).

    python benchmarks/bench_moe.py                           # 24 layers, hidden 1024, 64 experts, top-8
    python benchmarks/bench_moe.py --layers 4 --decode-steps 8
    python benchmarks/bench_moe.py --layers 2 --skip-hf --batch-sizes 1
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from bench_one_batch import make_runner, run_batch  # noqa: E402
from common_models import build_tokenizer, default_model_cache  # noqa: E402

NAME = "bench_moe"


def shape_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads, vocab_size=args.vocab_size,
                initializer_range=0.1, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
                eos_token_id=2, bos_token_id=0, pad_token_id=0)


def make_model(kind: str, args: argparse.Namespace) -> str:
    """Builds (once, then reuses) the random bf16 `kind` ('moe' or 'dense') model folder; returns its path."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    shape = shape_args(args)
    if kind == "moe":
        config = Qwen3MoeConfig(**shape, num_experts=args.experts, num_experts_per_tok=args.top_k,
                                moe_intermediate_size=args.expert_size, intermediate_size=args.expert_size,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        tag = f"qwen3moe-l{args.layers}-h{args.hidden}-e{args.experts}k{args.top_k}i{args.expert_size}"
    else:
        config = Qwen3Config(**shape, intermediate_size=args.top_k * args.expert_size)
        tag = f"qwen3dense-l{args.layers}-h{args.hidden}-i{args.top_k * args.expert_size}"
    folder = default_model_cache() / f"{tag}-v{args.vocab_size}-s{args.seed}"
    if (folder / "DONE").exists():
        return str(folder)
    building = Path(f"{folder}.building-{os.getpid()}")
    building.mkdir(parents=True, exist_ok=True)
    config.dtype = torch.bfloat16
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(building))
    del model
    build_tokenizer(args.vocab_size, building)
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    building.rename(folder)
    (folder / "DONE").write_text("ok\n")
    return str(folder)


def active_params(path: str, top_k: int, experts: int) -> tuple[int, int]:
    """(total, active per token) parameters in a model folder; an expert's weights count top_k / experts."""
    from safetensors import safe_open

    total = active = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
                active += n * top_k // experts if ".experts." in key else n
    return total, active


def radixlm_rows(path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    runner = make_runner(argparse.Namespace(batch_sizes=args.batch_sizes, input_len=args.input_len,
                                            decode_steps=args.decode_steps, page_size=1, dtype="bfloat16"), path)
    run_batch(runner, 1, min(args.input_len, 16), 2, args.seed)            # warm-up
    rows = [run_batch(runner, bs, args.input_len, args.decode_steps, args.seed + bs) for bs in args.batch_sizes]
    del runner
    gc.collect()
    return rows


def _timed_generate(model: Any, ids: torch.Tensor, new: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False)
    return time.perf_counter() - t0


def hf_rows(path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rows = []
    for bs in args.batch_sizes:
        gen = torch.Generator().manual_seed(args.seed + bs)
        ids = torch.randint(3, args.vocab_size, (bs, args.input_len), generator=gen)

        _timed_generate(model, ids, 2)                                   # warm-up
        # the fastest of 3 of each: one run of each on a shared machine gave a negative difference
        first = min(_timed_generate(model, ids, 1) for _ in range(3))
        step = (min(_timed_generate(model, ids, 1 + args.decode_steps) for _ in range(3)) - first) / args.decode_steps
        rows.append({"batch_size": bs, "input_len": args.input_len, "decode_steps": args.decode_steps,
                     "decode_step_median_ms": step * 1e3, "decode_tok_s": bs / step})
    del model
    gc.collect()
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_moe.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=384, help="moe_intermediate_size (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--skip-hf", action="store_true", help="leave out HF transformers")
    p.add_argument("--skip-dense", action="store_true", help="leave out the dense model")
    p.add_argument("--label", default="", help="suffix of the result file names (e.g. 'before')")
    p.add_argument("--seed", type=int, default=0)
    common.add_output_dir_arg(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = {"moe": make_model("moe", args)}
    if not args.skip_dense:
        paths["dense"] = make_model("dense", args)
    params = {k: active_params(p, args.top_k, args.experts) for k, p in paths.items()}
    runs: list[tuple[str, str, list[dict[str, Any]]]] = []
    with common.LoadMonitor() as load:
        runs.append(("radixlm", "moe", radixlm_rows(paths["moe"], args)))
        if "dense" in paths:
            runs.append(("radixlm", "dense", radixlm_rows(paths["dense"], args)))
        if not args.skip_hf:
            runs.append(("transformers", "moe", hf_rows(paths["moe"], args)))
    headers = ["engine", "model", "params (total / active)", "batch", "decode step ms", "decode tok/s"]
    table_rows = [[engine, kind, f"{params[kind][0] / 1e6:,.0f}M / {params[kind][1] / 1e6:,.0f}M", r["batch_size"],
                   r["decode_step_median_ms"], r["decode_tok_s"]] for engine, kind, rows in runs for r in rows]
    table = common.markdown_table(headers, table_rows)
    table += (f"\n\n{args.layers} layers, hidden {args.hidden}, {args.heads}/{args.kv_heads} heads; MoE: "
              f"{args.experts} experts of {args.expert_size}, top-{args.top_k}; dense: intermediate "
              f"{args.top_k * args.expert_size}; vocab {args.vocab_size}; bf16; prompt {args.input_len} tokens, "
              f"{args.decode_steps} decode steps (radixlm: median step; transformers: mean).")
    results = {"args": vars(args), "params": params, "runs": [{"engine": e, "model": k, "rows": rows}
                                                              for e, k, rows in runs]}
    name = f"{NAME}_{args.label}" if args.label else NAME
    common.write_results(name, args.output_dir, results, table, load.summary())
    return results


if __name__ == "__main__":
    main()
