"""N-gram speculative decoding on and off, side by side in one run, in process (no HTTP).

Two schedulers on the same weights, one with `--speculative-algorithm ngram`, are driven as a
closed loop: `--max-concurrency` requests in flight, a new one submitted as one finishes. Workloads:

    edit     rewrite a given Python function with one change (a renamed variable): the answer
             copies most of the prompt, the case prompt lookup is for. The functions are taken
             from radixlm's own source.
    random   random token ids as the prompt: little to look up; speculation must cost ~nothing.

Reported per workload and concurrency: output tok/s without and with speculation, the ratio, the
mean accept length (tokens per verify pass), the verify passes, and whether every greedy output
was identical with and without speculation. Between runs each scheduler's prefix cache is flushed.

    python benchmarks/bench_speculative.py                         # SmolLM2-135M-Instruct (GGUF Q4_1)
    python benchmarks/bench_speculative.py --max-concurrency 1 16 --num-prompts 4 16
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
import time
from pathlib import Path

import common

from radixlm.runtime.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReq
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs

EDIT_SOURCES = ("runtime/managers/batch_planner.py", "runtime/mem_cache/kv_manager.py",
                "runtime/managers/output_processor.py", "runtime/layers/sampler.py")


def edit_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Chat prompts asking to rewrite a 10-30 line function of radixlm with one variable renamed."""
    funcs = []
    for rel in EDIT_SOURCES:
        src = (common.REPO_ROOT / rel).read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and 10 <= node.end_lineno - node.lineno <= 30:
                names = sorted({a.arg for a in node.args.args if a.arg != "self"})
                if names:
                    funcs.append((ast.get_source_segment(src, node), names[0]))
    rng = random.Random(seed)
    rng.shuffle(funcs)
    out = []
    for code, name in (funcs * (n // max(len(funcs), 1) + 1))[:n]:
        text = (f"Rewrite this Python function with one change: rename the argument `{name}` to "
                f"`{name}_new`. Output only the code.\n\n```python\n{code}\n```")
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def random_prompts(tokenizer, n: int, seed: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(len(tokenizer), 30000)
    return [[rng.randrange(100, hi) for _ in range(length)] for _ in range(n)]


class Driver:
    """One in-process scheduler, fed as a closed loop."""

    def __init__(self, args: ServerArgs):
        from radixlm.runtime.managers.scheduler import Scheduler

        self.scheduler = Scheduler(args)
        self.scheduler.send = self._collect
        self.outputs: dict[str, list[int]] = {}
        self.done: set[str] = set()

    def _collect(self, msg) -> None:
        if isinstance(msg, BatchTokenIDOut):
            for out in msg.outputs:
                self.outputs.setdefault(out.rid, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.done.add(out.rid)

    def run(self, prompts: list[list[int]], concurrency: int, max_new_tokens: int, tag: str) -> dict:
        s = self.scheduler
        s.kv.flush()
        spec0 = (s.spec.totals.verify_ct, s.spec.totals.accepted_tokens) if s.spec else (0, 0)
        params = SamplingParams.from_dict(dict(max_new_tokens=max_new_tokens, temperature=0))
        rids = [f"{tag}-{i}" for i in range(len(prompts))]
        queue = list(zip(rids, prompts))
        in_flight: set[str] = set()
        start = time.perf_counter()
        while queue or s.has_work():
            while queue and len(in_flight) < concurrency:
                rid, prompt = queue.pop(0)
                s.handle(TokenizedGenerateReq(rid=rid, input_ids=list(prompt), sampling_params=params))
                in_flight.add(rid)
            s.step()
            in_flight -= self.done
        elapsed = time.perf_counter() - start
        tokens = sum(len(self.outputs[r]) for r in rids)
        verify = (s.spec.totals.verify_ct - spec0[0]) if s.spec else 0
        accepted = (s.spec.totals.accepted_tokens - spec0[1]) if s.spec else 0
        return {"seconds": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed, "verify_ct": verify,
                "accept_length": (accepted + verify) / verify if verify else None,
                "outputs": [self.outputs[r] for r in rids]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workloads", nargs="+", default=["edit", "random"], choices=["edit", "random"])
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-prompts", type=int, nargs="+", default=[4, 16],
                   help="prompts per --max-concurrency value (one count, or one per value)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-disable-by-batch-size", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    common.add_output_dir_arg(p)
    args = p.parse_args(argv)
    counts = args.num_prompts * len(args.max_concurrency) if len(args.num_prompts) == 1 else args.num_prompts
    if len(counts) != len(args.max_concurrency):
        sys.exit("--num-prompts takes one count or one per --max-concurrency value")

    from radixlm.runtime.managers.scheduler import set_torch_threads

    set_torch_threads()
    base = ServerArgs.from_kwargs(model_path=args.model_path, dtype=args.dtype,
                                  max_total_tokens=args.max_total_tokens).resolved()
    spec_kw = {"speculative_algorithm": "ngram"}
    if args.speculative_num_draft_tokens:
        spec_kw["speculative_num_draft_tokens"] = args.speculative_num_draft_tokens
    if args.speculative_disable_by_batch_size is not None:
        spec_kw["speculative_disable_by_batch_size"] = args.speculative_disable_by_batch_size
    spec_args = base.replace(**spec_kw)
    spec_args.validate()
    plain, spec = Driver(base), Driver(spec_args)
    tok = plain.scheduler.tokenizer
    warm = random_prompts(tok, 2, 99, 32)
    for d in (plain, spec):
        d.run(warm, 2, 8, "warm")

    rows, results = [], []
    with common.LoadMonitor() as load:
        for workload in args.workloads:
            for conc, n in zip(args.max_concurrency, counts):
                prompts = (edit_prompts(tok, n, args.seed) if workload == "edit"
                           else random_prompts(tok, n, args.seed, args.random_input_len))
                tag = f"{workload}-c{conc}"
                off = plain.run(prompts, conc, args.max_new_tokens, tag)
                on = spec.run(prompts, conc, args.max_new_tokens, tag)
                same = off.pop("outputs") == on.pop("outputs")
                ratio = on["tok_s"] / off["tok_s"]
                rows.append([workload, conc, n, off["tok_s"], on["tok_s"], ratio, on["accept_length"],
                             on["verify_ct"], "yes" if same else "NO"])
                results.append({"workload": workload, "concurrency": conc, "num_prompts": n, "off": off, "on": on,
                                "speedup": ratio, "greedy_identical": same})
                print(common.markdown_table(HEADERS, rows[-1:]), flush=True)
    t = spec_args
    table = common.markdown_table(HEADERS, rows) + (
        f"\n\nSpeculation: ngram, {t.speculative_num_draft_tokens} draft tokens, windows "
        f"{t.speculative_ngram_min_match_window_size}-{t.speculative_ngram_max_match_window_size}, off above "
        f"{t.speculative_disable_by_batch_size} decoding requests; model {Path(str(args.model_path)).name}, "
        f"greedy, {args.max_new_tokens} new tokens.")
    common.write_results("bench_speculative", args.output_dir, {"results": results, "args": vars(args)}, table,
                         load.summary())


HEADERS = ["workload", "concurrency", "prompts", "off tok/s", "on tok/s", "on/off", "accept len", "verify passes",
           "greedy identical"]

if __name__ == "__main__":
    main()
