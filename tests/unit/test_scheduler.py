"""Scheduler behaviour, in-process: greedy equality with HF under every batching mode, prefix
reuse, preemption, aborts, n > 1 sharing, stops and logprobs. The KV pool must be fully free
after every run (SchedulerHarness.run asserts it)."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import SchedulerHarness, hf_greedy, hf_model, random_prompts

N_REQS = 16


@functools.cache
def _workload(path: str) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """16 prompts in 4 groups sharing a 48-token prefix; mixed output lengths; HF references."""
    prompts = random_prompts(N_REQS, 1900, seed=1, shared=48, groups=4, lo=4, hi=40)
    lens = [4 + (i * 7) % 21 for i in range(N_REQS)]
    refs = [hf_greedy(path, p, n) for p, n in zip(prompts, lens)]
    return prompts, lens, refs


def _run_workload(path: str, **server_args) -> SchedulerHarness:
    prompts, lens, refs = _workload(path)
    h = SchedulerHarness(path, **server_args)
    for i, (p, n) in enumerate(zip(prompts, lens)):
        h.submit(f"r{i}", p, max_new_tokens=n, temperature=0, ignore_eos=True)
    res = h.run()
    for i in range(N_REQS):
        assert res[f"r{i}"]["output_ids"] == refs[i], f"request {i} differs from HF under {server_args}"
        assert res[f"r{i}"]["finish_reason"] == {"type": "length", "length": lens[i]}
    return h


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_each_arch(tiny_models, arch):
    _run_workload(tiny_models[arch])


@pytest.mark.parametrize("config", [
    dict(disable_radix_cache=True),
    dict(chunked_prefill_size=32),
    dict(page_size=16),
    dict(page_size=16, chunked_prefill_size=32),
    dict(schedule_policy="lpm"),
    dict(schedule_policy="dfs-weight"),
    dict(schedule_policy="lof"),
    dict(schedule_policy="priority"),
    dict(max_running_requests=3),
    dict(prefill_step_tokens=40),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_greedy_matches_hf_under_batching_modes(llama_path, config):
    _run_workload(llama_path, **config)


def test_prefill_steps_are_timed_for_the_auto_pace(llama_path):
    h = _run_workload(llama_path)                       # CPU default: auto
    pace = h.scheduler.planner.pace
    assert h.args.prefill_step_tokens == -1 and pace.seconds_per_row is not None and pace.target() >= 128


@pytest.mark.parametrize("page_size,total", [(1, 320), (16, 256)])
def test_preemption_keeps_greedy_outputs(llama_path, page_size, total):
    # a small pool and almost no reserved decode room: decoding must run out and retract
    h = _run_workload(llama_path, max_total_tokens=total, page_size=page_size, max_prefill_tokens=256,
                      schedule_conservativeness=0.0)
    assert h.scheduler.planner.stats().num_preemptions > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_second_identical_prompt_hits_cache(llama_path, page_size):
    prompt = random_prompts(1, 1900, seed=5, lo=60, hi=60)[0]
    h = SchedulerHarness(llama_path, page_size=page_size)
    h.submit("a", prompt, max_new_tokens=4, temperature=0)
    h.run()
    h.submit("b", prompt, max_new_tokens=4, temperature=0)
    res = h.run()
    assert res["b"]["cached_tokens"] >= len(prompt) - page_size
    assert res["b"]["output_ids"] == res["a"]["output_ids"]


def test_abort_frees_everything(llama_path):
    h = SchedulerHarness(llama_path)
    prompts = random_prompts(4, 1900, seed=2)
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, max_new_tokens=50, ignore_eos=True)
    for _ in range(3):
        h.scheduler.step()
    from radixlm.runtime.managers.io_struct import AbortReq

    h.scheduler.handle(AbortReq("r1"))
    h.scheduler.handle(AbortReq("r3"))
    res = h.run()
    assert res["r1"]["finish_reason"]["type"] == "abort"
    assert res["r0"]["finish_reason"]["type"] == "length"


def test_timeout_aborts(llama_path):
    from radixlm.runtime.managers.io_struct import TokenizedGenerateReq
    from radixlm.runtime.sampling_params import SamplingParams

    h = SchedulerHarness(llama_path)
    h.submit_raw(TokenizedGenerateReq("t", [5, 6, 7], SamplingParams(max_new_tokens=10**4, ignore_eos=True),
                                      timeout=0.3))
    res = h.run()
    assert res["t"]["finish_reason"] == {"type": "abort", "message": "timeout"}


def test_n_siblings_share_one_prefill(llama_path):
    from radixlm.runtime.managers.io_struct import TokenizedGenerateReq
    from radixlm.runtime.sampling_params import SamplingParams

    prompt = random_prompts(1, 1900, seed=9, lo=80, hi=80)[0]
    h = SchedulerHarness(llama_path)
    for i in range(3):
        h.submit_raw(TokenizedGenerateReq(f"g-{i}", prompt, SamplingParams(max_new_tokens=5, temperature=0),
                                          group_rid="g"))
    res = h.run()
    cached = sorted(res[f"g-{i}"]["cached_tokens"] for i in range(3))
    assert cached[0] == 0 and cached[1] >= len(prompt) - 1 and cached[2] >= len(prompt) - 1
    assert res["g-0"]["output_ids"] == res["g-1"]["output_ids"] == res["g-2"]["output_ids"]


def test_prefill_only_and_stops(llama_path):
    prompt = random_prompts(1, 1900, seed=3, lo=20, hi=20)[0]
    ref = hf_greedy(llama_path, prompt, 10)
    h = SchedulerHarness(llama_path)
    h.submit("zero", prompt, max_new_tokens=0)
    h.submit("stop_id", prompt, max_new_tokens=10, temperature=0, stop_token_ids=[ref[3]], ignore_eos=True)
    h.submit("min_new", prompt, max_new_tokens=10, temperature=0, min_new_tokens=10,
             stop_token_ids=[ref[0]], ignore_eos=True)
    res = h.run()
    assert res["zero"]["output_ids"] == [] and res["zero"]["finish_reason"] == {"type": "length", "length": 0}
    first = ref.index(ref[3])
    assert res["stop_id"]["output_ids"] == ref[: first + 1]
    assert res["stop_id"]["finish_reason"] == {"type": "stop", "matched": ref[3]}
    assert len(res["min_new"]["output_ids"]) == 10


def test_stop_string(llama_path):
    h = SchedulerHarness(llama_path)
    tok = h.scheduler.tokenizer
    prompt = random_prompts(1, 1900, seed=4, lo=20, hi=20)[0]
    ref = hf_greedy(llama_path, prompt, 12)
    stop = tok.decode(ref[5:7])
    assert stop
    h.submit("s", prompt, max_new_tokens=12, temperature=0, stop=[stop], ignore_eos=True)
    res = h.run()
    assert res["s"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop in tok.decode(res["s"]["output_ids"])
    assert len(res["s"]["output_ids"]) <= 7


def test_input_logprobs_match_hf(llama_path):
    from radixlm.runtime.managers.io_struct import TokenizedGenerateReq
    from radixlm.runtime.sampling_params import SamplingParams

    prompt = random_prompts(1, 1900, seed=6, lo=30, hi=30)[0]
    with torch.no_grad():
        logits = hf_model(llama_path)(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    h = SchedulerHarness(llama_path, chunked_prefill_size=16)
    h.submit("warm", prompt[:20], max_new_tokens=1)      # puts a prefix in the cache
    h.run()
    h.submit_raw(TokenizedGenerateReq("lp", prompt, SamplingParams(max_new_tokens=3, temperature=0),
                                      return_logprob=True, logprob_start_len=0, top_logprobs_num=2))
    res = h.run()
    out = res["lp"]
    assert out["input_token_logprobs"][0] == (None, prompt[0])
    got = [lp for lp, _ in out["input_token_logprobs"][1:]]
    want = [float(ref[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-3)
    assert len(out["input_top_logprobs"]) == len(prompt)
    assert len(out["output_token_logprobs"]) == 3


def test_seeded_sampling_is_batch_invariant(llama_path):
    prompt = random_prompts(1, 1900, seed=7, lo=10, hi=10)[0]
    solo = SchedulerHarness(llama_path)
    solo.submit("s", prompt, max_new_tokens=16, temperature=1.0, sampling_seed=1234, ignore_eos=True)
    a = solo.run()["s"]["output_ids"]
    mixed = SchedulerHarness(llama_path)
    for i, p in enumerate(random_prompts(5, 1900, seed=8)):
        mixed.submit(f"o{i}", p, max_new_tokens=20, temperature=0.8, ignore_eos=True)
    mixed.submit("s", prompt, max_new_tokens=16, temperature=1.0, sampling_seed=1234, ignore_eos=True)
    b = mixed.run()["s"]["output_ids"]
    assert a == b


def test_late_divergence_miss_is_diagnosed(llama_path, caplog):
    import logging

    system = random_prompts(1, 1900, seed=11, lo=400, hi=400)[0]
    unique = SchedulerHarness(llama_path)
    with caplog.at_level(logging.WARNING):
        for i in range(4):   # a unique "uuid" in front of a shared system prompt: every request misses
            unique.submit(f"u{i}", [3 + i, 7 + i, 11 + i] + system + [42, 43], max_new_tokens=1)
            unique.run()
    assert unique.scheduler.planner.stats().late_divergence_misses == 3
    assert "late-divergence miss" in caplog.text and "diverges from the cache at token 0" in caplog.text
    shared = SchedulerHarness(llama_path)
    for i in range(4):       # the same system prompt in front: hits, never diagnosed
        shared.submit(f"s{i}", system + [3 + i, 7 + i], max_new_tokens=1)
        shared.run()
    assert shared.scheduler.planner.stats().late_divergence_misses == 0
    assert shared.scheduler.planner.stats().prefix_cache_hits > 3 * 390


def test_concurrent_shared_prefix_is_prefilled_once(llama_path):
    prompts = random_prompts(8, 1900, seed=12, shared=200, lo=5, hi=10)
    h = SchedulerHarness(llama_path)
    for i, p in enumerate(prompts):          # all arrive together, nothing cached yet
        h.submit(f"c{i}", p, max_new_tokens=2, temperature=0)
    res = h.run()
    cached = sorted(res[f"c{i}"]["cached_tokens"] for i in range(8))
    assert cached[0] == 0 and all(c >= 192 for c in cached[1:]), cached


def test_operator_log_lines(llama_path, caplog):
    import logging
    import re

    h = SchedulerHarness(llama_path, decode_log_interval=3)
    for i, p in enumerate(random_prompts(3, 1900, seed=13, lo=10, hi=20)):
        h.submit(f"r{i}", p, max_new_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="radixlm.scheduler"):
        h.run()
    prefill = [m for m in caplog.messages if m.startswith("Prefill batch.")]
    decode = [m for m in caplog.messages if m.startswith("Decode batch.")]
    assert prefill and re.fullmatch(r"Prefill batch\. #new-seq: 3, #new-token: \d+, #cached-token: 0, "
                                    r"token usage: [\d.]+, #running-req: 0, #queue-req: 0", prefill[0]), prefill
    assert len(decode) == 7 // 3, decode        # 7 decode steps after the prefill, one line per 3
    assert re.fullmatch(r"Decode batch\. #running-req: 3, #token: \d+, token usage: [\d.]+, "
                        r"gen throughput \(token/s\): [\d.]+, #queue-req: 0", decode[0]), decode
