"""Scale-out through the real processes: TP=2 over gloo equals TP=1 and HF, also split over two
"nodes" (two servers on loopback); DP=2 with the cache-aware router beats round-robin on prefix
hits, and a session's turns stay on the replica holding its KV; a dead TP rank takes the engine down; an idle TP=2 engine costs (almost) no CPU;
n-gram speculation under TP=2 equals HF."""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest
from helpers import hf_greedy, random_prompts
from server_fixtures import REPO_ROOT, free_port, launch_server_process, start_server

import radixlm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_equals_hf(tiny_models, arch):
    path = tiny_models[arch]
    prompts = random_prompts(4, 1900, seed=31, shared=24, groups=2)
    with radixlm.Engine(model_path=path, tp_size=2, dtype="float32", max_total_tokens=4000) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                                "ignore_eos": True})
        info = eng.get_server_info()
    for out, prompt in zip(outs, prompts):
        assert out["output_ids"] == hf_greedy(path, prompt, 10)
    assert info["tp_size"] == 2


def test_tp2_speculative_equals_hf(llama_path):
    """n-gram speculation with TP=2: every rank plans the same batches (the proposals depend on step
    times, which rank 0 measures and broadcasts), greedy tokens equal HF's, proposals verified."""
    prompts = [p * 3 for p in random_prompts(2, 1900, seed=5, lo=10, hi=16)]   # repeating: proposals match
    with radixlm.Engine(model_path=llama_path, tp_size=2, dtype="float32", max_total_tokens=4000,
                        speculative_algorithm="ngram") as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                                "ignore_eos": True})
    for out, prompt in zip(outs, prompts):
        assert out["output_ids"] == hf_greedy(llama_path, prompt, 24)
    assert sum(out["meta_info"]["spec_verify_ct"] for out in outs) > 0


def test_tp2_over_two_nodes_equals_hf(llama_path):
    """--nnodes 2 on loopback: node 1 runs TP rank 1 only (no HTTP, no detokenizer), node 0 serves
    and broadcasts each step; greedy tokens equal HF's; node 1 exits once node 0 has stopped."""
    common = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}",
              "--dtype", "float32", "--max-total-tokens", "4000")
    worker = launch_server_process(llama_path, *common, "--node-rank", "1", ready="none", cwd=REPO_ROOT)
    try:
        head = start_server(llama_path, *common, "--node-rank", "0")
        try:
            worker.wait_ready(60, "worker")
            assert "TP ranks [1]" in worker.log() and "detokenizer" not in worker.log()
            for prompt in random_prompts(2, 1900, seed=33):
                r = httpx.post(head.url("/generate"), timeout=60, json={
                    "input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
                assert r.json()["output_ids"] == hf_greedy(llama_path, prompt, 8)
        finally:
            head.stop()
        assert worker.proc.wait(30) != 0          # its scheduler lost node 0: the worker exits too
    finally:
        worker.stop()


def test_multi_node_flags_are_checked(llama_path):
    with pytest.raises(ValueError, match="dist-init-addr"):
        radixlm.Engine(model_path=llama_path, tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="multiple of --nnodes"):
        radixlm.Engine(model_path=llama_path, tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="launch_server"):
        radixlm.Engine(model_path=llama_path, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000")


def test_tp_size_must_divide_heads(llama_path):
    with pytest.raises(ValueError, match="divisible"):
        radixlm.Engine(model_path=llama_path, tp_size=3, dtype="float32", max_total_tokens=4000)


def _session_turns_stay_on_their_replica(eng: radixlm.Engine) -> None:
    """Each turn continues the previous one; its KV is locked on the replica that ran it, so the
    next turn must go there (round robin would alternate) to be a prefix hit."""
    sid = eng.open_session(8192)
    parent, full = None, random_prompts(1, 1900, seed=40)[0]
    for turn in range(4):
        own = full if parent is None else [7, 8, 9, 10]
        out = eng.generate(input_ids=own, rid=f"{sid}-{turn}", session_params={"id": sid, "rid": parent},
                           sampling_params={"max_new_tokens": 6, "ignore_eos": True})
        if parent is not None:
            assert out["meta_info"]["cached_tokens"] >= len(full) - 1, (turn, out["meta_info"])
            full = full + own
        full, parent = full + out["output_ids"], f"{sid}-{turn}"
    eng.close_session(sid)
    with pytest.raises(ValueError, match="Unknown session"):
        eng.close_session(sid)


def _prefix_hit_rate(path: str, method: str) -> float:
    prompts = random_prompts(64, 1900, seed=32, shared=160, groups=8, lo=8, hi=16)
    order = list(prompts)
    random.Random(0).shuffle(order)          # groups arrive in no particular order
    with radixlm.Engine(model_path=path, dp_size=2, load_balance_method=method, dtype="float32",
                        max_total_tokens=20000) as eng:
        for start in range(0, 64, 8):      # waves of 8 concurrent requests
            eng.generate(input_ids=order[start:start + 8], sampling_params={"max_new_tokens": 2})
        states = eng.get_server_info()["internal_states"][0]["dp_states"]
        if method == "round_robin":
            _session_turns_stay_on_their_replica(eng)
    assert len(states) == 2 and all(s["prefix_cache_queries"] > 0 for s in states)   # both replicas used
    hits = sum(s["prefix_cache_hits"] for s in states)
    queries = sum(s["prefix_cache_queries"] for s in states)
    return hits / queries


def test_dp2_cache_aware_beats_round_robin(llama_path):
    rr = _prefix_hit_rate(llama_path, "round_robin")
    ca = _prefix_hit_rate(llama_path, "cache_aware")
    assert ca > rr, (ca, rr)


def test_killing_a_tp_rank_brings_engine_down(llama_path):
    eng = radixlm.Engine(model_path=llama_path, tp_size=2, dtype="float32", max_total_tokens=4000)
    try:
        pid = eng.subprocesses.pid_of("scheduler dp0 tp1")
        assert pid
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 200, "ignore_eos": True})
        assert time.monotonic() - start < 10
    finally:
        eng.shutdown()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (from /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_idle_tp2_engine_does_not_spin(llama_path):
    with radixlm.Engine(model_path=llama_path, tp_size=2, dtype="float32", max_total_tokens=4000) as eng:
        eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})
        time.sleep(1.0)                      # past the last stats message and any thread-pool spin
        pids = list(eng.subprocesses.processes[name].pid for name in eng.subprocesses.processes)
        before = [_cpu_seconds(pid) for pid in pids]
        time.sleep(5.0)
        used = sum(_cpu_seconds(pid) - b for pid, b in zip(pids, before))
        names = list(eng.subprocesses.processes)
    assert any("tp1" in n for n in names)
    # a spinning loop costs ~5 CPU-seconds here (one core busy) and a 10 ms poll about 1; measured idle
    # 0.17-0.52 (0.50 and 0.52 on a loaded machine, where the old bound of 0.5 failed), cause not found
    assert used < 1.0, f"idle TP=2 engine used {used:.2f} CPU-seconds in 5 s ({names})"
