"""Structured generation throughput, in one run on the same model and the same prompts:

    1. unconstrained decode                       (ignore_eos, fixed length)
    2. JSON-schema constrained, jump-forward off
    3. JSON-schema constrained, jump-forward on
    4. outlines-core index compile time for a 5-field schema, at a ~2k and a ~32k vocabulary

Throughput is output tokens per second of wall time through `radixlm.Engine`; "tokens per
forward pass" is output tokens / forward passes (jump-forward appends forced text in one pass).

    python benchmarks/bench_structured.py                      # tiny llama (2k vocab), 32 requests
    python benchmarks/bench_structured.py --num-requests 8 --skip-32k
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from tqdm import tqdm  # noqa: E402

NAME = "bench_structured"
REPO = Path(__file__).resolve().parent.parent
# long fixed keys: the case jump-forward is for
SCHEMA = {"type": "object", "properties": {
    "customer_identifier": {"type": "integer"},
    "customer_display_name": {"type": "string", "maxLength": 12},
    "subscription_is_active": {"type": "boolean"},
    "preferred_contact_channel": {"enum": ["email", "telephone", "postal_mail"]},
    "account_balance_in_cents": {"type": "integer"}},
    "required": ["customer_identifier", "customer_display_name", "subscription_is_active",
                 "preferred_contact_channel", "account_balance_in_cents"]}


def tiny_model() -> str:
    sys.path.insert(0, str(REPO))
    from tests.conftest import ensure_tiny_models

    return ensure_tiny_models()["llama"]


def run_engine(model: str, prompts: list[list[int]], params: dict[str, Any], jump_forward: bool) -> dict:
    import radixlm

    with radixlm.Engine(model_path=model, dtype="float32", max_total_tokens=60000,
                        disable_jump_forward=not jump_forward) as eng:
        eng.generate(input_ids=prompts[:4], sampling_params=params)   # warm-up (first-call costs, grammar compile)
        start = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - start
    texts = [o["text"] for o in outs]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    passes = sum(o["meta_info"].get("forward_passes", 0) for o in outs)
    jumped = sum(o["meta_info"].get("jump_forward_tokens", 0) for o in outs)
    valid = 0
    for t in texts:
        try:
            json.loads(t)
            valid += 1
        except ValueError:
            pass
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "forward_passes": passes, "tokens_per_pass": tokens / passes if passes else None,
            "jump_forward_tokens": jumped, "valid_json": valid, "requests": len(outs)}


def compile_times(skip_32k: bool) -> dict[str, float]:
    from transformers import AutoTokenizer

    from radixlm.runtime.constrained import GrammarBackend

    out = {}
    vocabs = {"2k": tiny_model()}
    if not skip_32k:
        vocabs["32k"] = str(train_tokenizer(32000))
    for name, path in tqdm(vocabs.items(), desc="compile"):
        tok = AutoTokenizer.from_pretrained(path)
        backend = GrammarBackend(tok, len(tok), [tok.eos_token_id or 0])
        start = time.perf_counter()
        backend.compile("json_schema", json.dumps(SCHEMA))
        out[f"compile_s_{name}_vocab"] = time.perf_counter() - start
        out[f"vocab_size_{name}"] = len(tok)
        backend.shutdown()
    return out


def train_tokenizer(vocab_size: int) -> Path:
    """A byte-level BPE with `vocab_size` entries trained on stdlib text (cached)."""
    target = common.default_model_cache() / f"bpe-{vocab_size}"
    if (target / "tokenizer.json").exists():
        return target
    from radixlm.testing.models import stdlib_texts, train_bpe_tokenizer

    train_bpe_tokenizer(stdlib_texts(12_000_000), vocab_size).save_pretrained(str(target))
    return target


def run_cases(model: str, prompts: list[list[int]], base: dict[str, Any]) -> dict[str, Any]:
    schema = json.dumps(SCHEMA)
    # a penalty keeps a random model from repeating digits forever inside unbounded integers
    cases = [("unconstrained", {**base, "ignore_eos": True}, True),
             ("json_schema, jump-forward off", {**base, "json_schema": schema, "frequency_penalty": 1.0}, False),
             ("json_schema, jump-forward on", {**base, "json_schema": schema, "frequency_penalty": 1.0}, True)]
    return {name: run_engine(model, prompts, params, jf) for name, params, jf in tqdm(cases, desc="cases")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="model folder (default: the tiny test llama)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--skip-32k", action="store_true", help="skip training the 32k tokenizer (~1 min)")
    common.add_output_dir_arg(p)
    args = p.parse_args(argv)
    model = args.model_path or tiny_model()
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import random_prompts

    prompts = random_prompts(args.num_requests, 1900, seed=0, lo=16, hi=64)
    base = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    rows, results = [], {}
    with common.LoadMonitor() as monitor:
        results = run_cases(model, prompts, base)
        results["compile"] = compile_times(args.skip_32k)
    load = monitor.summary()
    unc = results["unconstrained"]["tokens_per_s"]
    for name, r in results.items():
        if name == "compile":
            continue
        rows.append([name, r["output_tokens"], common.fmt(r["tokens_per_s"], 1), common.fmt(r["tokens_per_s"] / unc),
                     common.fmt(r["tokens_per_pass"]), r["jump_forward_tokens"], f"{r['valid_json']}/{r['requests']}"])
    table = common.markdown_table(["case", "output tokens", "tok/s", "vs unconstrained", "tokens/pass",
                                   "jump-forward tokens", "valid JSON"], rows)
    table += "\n\n" + common.markdown_table(["vocab", "5-field schema compile (s)"],
                                            [[k, common.fmt(v, 3)] for k, v in results["compile"].items()
                                             if k.startswith("compile")])
    common.write_results(NAME, args.output_dir, {"cases": results}, table, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
