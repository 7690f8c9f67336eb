"""N-gram speculative decoding on and off, side by side in one run, in process (no HTTP).

Two schedulers on the same weights, one with `--speculative-algorithm ngram`, are driven as a
closed loop: `--max-concurrency` requests in flight, a new one submitted as one finishes. Workloads:

    edit     rewrite a given Python function with one change (a renamed variable): the answer
             copies most of the prompt, the case prompt lookup is for. The functions are taken
             from radixlm's own source.
    agent    bench_agent.py's multi-turn tool loop, in process: a system prompt with the tool
             schemas (JSON), a user task, then --agent-turns steps; after each step the assistant's
             answer and one tool result are appended to the history and the whole conversation is
             re-rendered with the chat template and re-tokenized, as an OpenAI client and server
             would. The tool results are real text (files of this repository) instead of
             bench_agent's random text, so that quoting them back is possible; the tool calls are
             not executed (each step's result is the next file, whatever was called).
    random   random token ids as the prompt: little to look up; speculation must cost ~nothing.

Reported per workload and concurrency: output tok/s without and with speculation, the ratio, the
mean accept length (tokens per verify pass), the verify passes, and whether every greedy output
was identical with and without speculation (for agent, every step of every conversation; a step
that differs changes the later steps' prompts). Between runs each scheduler's prefix cache is
flushed; `--max-concurrency` counts requests in flight (agent: one step of each of that many
conversations). A conversation whose next prompt plus --max-new-tokens would not fit the model's
context ends there (counted as "skipped" in the result file).

    python benchmarks/bench_speculative.py                         # SmolLM2-135M-Instruct (GGUF Q4_1)
    python benchmarks/bench_speculative.py --max-concurrency 1 16 --num-prompts 4 16
    python benchmarks/bench_speculative.py --workloads agent --agent-turns 4   # prompts = conversations
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import time
from pathlib import Path
from typing import Generator, Iterator

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


AGENT_FILES = ("runtime/mem_cache/kv_manager.py", "runtime/managers/batch_planner.py",
               "runtime/speculative/ngram.py", "runtime/layers/sampler.py", "runtime/managers/output_processor.py",
               "runtime/mem_cache/radix_cache.py", "runtime/sampling_params.py", "runtime/managers/scheduler.py")
AGENT_TASKS = ("Find where rejected draft tokens free their KV slots and explain it.",
               "A request that is aborted keeps its KV slots. Find the bug and propose a fix.",
               "Add a comment to every function that allocates KV slots, quoting its first line.",
               "List the functions that touch the prefix cache and what each one does.")
AGENT_FILE_CHARS = 1800         # a tool result: the first this many characters of the file


def render(tokenizer, messages: list[dict]) -> list[int]:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer.encode(text, add_special_tokens=False)


def agent_conversation(tokenizer, c: int, turns: int, seed: int) -> Generator[list[int], list[int], None]:
    """One conversation: yields each step's prompt, receives that step's output token ids."""
    from bench_agent import TOOLS

    rng = random.Random(seed * 1000 + c)
    tools = json.dumps([t["function"] for t in TOOLS], indent=1)
    messages = [
        {"role": "system", "content": "You are a coding agent working in a Python repository. You can call these "
         f"tools:\n{tools}\nTo call one, answer with <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}"
         "</tool_call>. When you refer to code, quote the exact lines."},
        {"role": "user", "content": AGENT_TASKS[c % len(AGENT_TASKS)]}]
    files = rng.sample(AGENT_FILES, min(turns, len(AGENT_FILES)))
    for turn in range(turns):
        output = yield render(tokenizer, messages)
        path = files[turn % len(files)]
        messages.append({"role": "assistant", "content": tokenizer.decode(output, skip_special_tokens=True)})
        messages.append({"role": "tool", "content": json.dumps(
            {"name": "read_file", "path": path,
             "content": (common.REPO_ROOT / path).read_text()[:AGENT_FILE_CHARS]})})


def single_turn(prompt: list[int]) -> Iterator[list[int]]:
    yield prompt


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

    def run(self, conversations: list, concurrency: int, max_new_tokens: int, tag: str) -> dict:
        """Serves every conversation (a generator of prompts, sent each step's output) with at most
        `concurrency` requests in flight; a conversation's next step queues as its last one ends."""
        s = self.scheduler
        s.kv.flush()
        spec0 = (s.spec.totals.verify_ct, s.spec.totals.accepted_tokens) if s.spec else (0, 0)
        params = SamplingParams.from_dict(dict(max_new_tokens=max_new_tokens, temperature=0))
        queue = [(f"{tag}-{c}-0", next(conv), conv) for c, conv in enumerate(conversations)]
        in_flight: dict[str, Generator] = {}
        rids, skipped = [], 0
        start = time.perf_counter()
        while queue or s.has_work():
            while queue and len(in_flight) < concurrency:
                rid, prompt, conv = queue.pop(0)
                if len(prompt) + max_new_tokens > s.runner.context_len:   # a conversation that outgrew the
                    skipped += 1                                           # context ends before this step
                    continue
                s.handle(TokenizedGenerateReq(rid=rid, input_ids=list(prompt), sampling_params=params))
                in_flight[rid] = conv
                rids.append(rid)
            s.step()
            for rid in [r for r in in_flight if r in self.done]:
                conv = in_flight.pop(rid)
                try:
                    prompt = conv.send(self.outputs[rid])
                except StopIteration:
                    continue
                head, c, turn = rid.rsplit("-", 2)
                queue.insert(0, (f"{head}-{c}-{int(turn) + 1}", prompt, conv))
        elapsed = time.perf_counter() - start
        tokens = sum(len(self.outputs[r]) for r in rids)
        verify = (s.spec.totals.verify_ct - spec0[0]) if s.spec else 0
        accepted = (s.spec.totals.accepted_tokens - spec0[1]) if s.spec else 0
        return {"seconds": elapsed, "requests": len(rids), "skipped": skipped, "output_tokens": tokens,
                "tok_s": tokens / elapsed,
                "verify_ct": verify, "accept_length": (accepted + verify) / verify if verify else None,
                "outputs": {r: self.outputs[r] for r in rids}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workloads", nargs="+", default=["edit", "agent", "random"], choices=["edit", "agent", "random"])
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-prompts", type=int, nargs="+", default=[4, 16],
                   help="prompts (agent: conversations) per --max-concurrency value (one count, or one per value)")
    p.add_argument("--agent-turns", type=int, default=4, help="steps per agent conversation")
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
    for d in (plain, spec):
        d.run([single_turn(p) for p in random_prompts(tok, 2, 99, 32)], 2, 8, "warm")

    rows, results = [], []
    with common.LoadMonitor() as load:
        for workload in args.workloads:
            for conc, n in zip(args.max_concurrency, counts):
                def conversations():
                    if workload == "agent":
                        return [agent_conversation(tok, c, args.agent_turns, args.seed) for c in range(n)]
                    prompts = (edit_prompts(tok, n, args.seed) if workload == "edit"
                               else random_prompts(tok, n, args.seed, args.random_input_len))
                    return [single_turn(p) for p in prompts]

                tag = f"{workload}-c{conc}"
                off = plain.run(conversations(), conc, args.max_new_tokens, tag)
                on = spec.run(conversations(), conc, args.max_new_tokens, tag)
                same = off.pop("outputs") == on.pop("outputs")
                ratio = on["tok_s"] / off["tok_s"]
                rows.append([workload, conc, on["requests"], off["tok_s"], on["tok_s"], ratio, on["accept_length"],
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


HEADERS = ["workload", "concurrency", "requests", "off tok/s", "on tok/s", "on/off", "accept len", "verify passes",
           "greedy identical"]

if __name__ == "__main__":
    main()
