"""Test helpers: HF greedy references and an in-process scheduler harness.

`SchedulerHarness` drives a real `Scheduler` (model runner, KV pool, radix tree, planner) step by
step in the test process, with no ZMQ and no child processes, so scheduling behaviour can be
checked exactly and fast. Process-level behaviour is tested through Engine and the server.
"""

from __future__ import annotations

import functools
import random
from typing import NoReturn

import pytest
import torch

from radixlm.runtime import env
from radixlm.runtime.managers.io_struct import BatchTokenIDOut, TokenizedGenerateReq
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server_args import ServerArgs


def missing_dependency(reason: str) -> NoReturn:
    """Skip for a missing optional test dependency, or fail where RADIXLM_REQUIRE_TEST_DEPS=1 (.ci/run),
    so CI cannot pass by skipping what a test exists to check."""
    if env.REQUIRE_TEST_DEPS.get():
        pytest.fail(f"{reason} (RADIXLM_REQUIRE_TEST_DEPS=1)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation with HF transformers and its KV cache; never stops early."""
    model = hf_model(path)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(n: int, vocab: int, seed: int, shared: int = 0, lo: int = 8, hi: int = 64,
                   groups: int = 1) -> list[list[int]]:
    """n prompts of random ids in [3, vocab); prompts in one of `groups` groups share a `shared`-token prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(shared)] for _ in range(groups)]
    return [prefixes[i % groups] + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
            for i in range(n)]


class SchedulerHarness:
    def __init__(self, model_path: str, **kwargs):
        from radixlm.runtime.managers.scheduler import Scheduler

        defaults = dict(model_path=model_path, device="cpu", dtype="float32", max_total_tokens=20000,
                        debug_check_kv=True)
        defaults.update(kwargs)
        self.args = ServerArgs.from_kwargs(**defaults).resolved()
        self.scheduler = Scheduler(self.args)
        self.scheduler.send = self._collect
        self.results: dict[str, dict] = {}
        self.messages: list = []

    def _collect(self, msg) -> None:
        self.messages.append(msg)
        if isinstance(msg, BatchTokenIDOut):
            for out in msg.outputs:
                r = self.results.setdefault(out.rid, {"output_ids": [], "finish_reason": None})
                r["output_ids"].extend(out.new_token_ids)
                r["finish_reason"] = out.finish_reason
                r["cached_tokens"] = out.cached_tokens
                r["prompt_tokens"] = out.prompt_tokens
                r["last"] = out
                if out.input_token_logprobs is not None:
                    r["input_token_logprobs"] = out.input_token_logprobs
                    r["input_top_logprobs"] = out.input_top_logprobs
                if out.output_token_logprobs is not None:
                    r.setdefault("output_token_logprobs", []).extend(out.output_token_logprobs)

    def submit(self, rid: str, input_ids: list[int], **sampling) -> None:
        params = SamplingParams.from_dict(sampling)
        self.scheduler.handle(TokenizedGenerateReq(rid=rid, input_ids=list(input_ids), sampling_params=params))

    def submit_raw(self, msg: TokenizedGenerateReq) -> None:
        self.scheduler.handle(msg)

    def run(self, max_steps: int = 100000) -> dict[str, dict]:
        steps = 0
        while self.scheduler.has_work():
            for msg in self.scheduler.timeout_aborts():   # what the process loop does each step
                self.scheduler.handle(msg)
            self.scheduler.step()
            steps += 1
            assert steps < max_steps, "scheduler did not finish"
        self.assert_no_leak()
        return self.results

    def assert_no_leak(self) -> None:
        s = self.scheduler
        kv, pool = s.kv, s.kv.req_to_token_pool
        assert kv.allocator.available_size() + kv.prefix_cache.evictable_size() == kv.allocator.size, \
            s.internal_state()
        assert kv.prefix_cache.protected_size() == 0
        assert pool.available_size() == pool.size
        assert kv.is_fully_free()
