"""The offline Engine through the real processes: HF-equal greedy outputs, batches, streaming,
abort, prefix-cache reporting, idle CPU, bad input, and child-process failure.

One Engine is shared by the module (startup costs seconds); the failure tests start their own.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import radixlm
from radixlm.testing.server import pid_alive

pytestmark = pytest.mark.timeout(180)     # a hang (a lost wake-up, a dead child) fails, never blocks

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):",
    "import os\nimport sys\n\nclass Config:\n    def load(self):",
    "# Copyright 2001 Python Software Foundation\n\"\"\"Tools for parsing",
    "x = [i * i for i in range(10)]\nprint(",
    "return",
]
MAX_NEW = [24, 16, 32, 8, 40, 12]


@pytest.fixture(scope="module")
def engine(llama_path: str):
    with radixlm.Engine(model_path=llama_path, max_total_tokens=16384, random_seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(llama_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


def hf_greedy(hf_model, ids: list[int], max_new: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def greedy(max_new: int, **kw) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0.0, **kw}


def assert_idle_and_free(engine) -> None:
    state = engine.get_server_info()["internal_states"][0]
    assert state["kv_free_tokens"] + state["kv_evictable_tokens"] == state["kv_total_tokens"], state
    assert state["req_rows_free"] == state["req_rows_total"], state
    assert engine.tokenizer_manager.num_running_requests() == 0


# ------------------------------------------------------------------ correctness
def test_greedy_batch_equals_hf(engine, hf_model):
    tok = engine.tokenizer
    eos = tok.eos_token_id
    outs = engine.generate(PROMPTS, [greedy(m) for m in MAX_NEW])
    assert isinstance(outs, list) and len(outs) == len(PROMPTS)
    for prompt, max_new, out in zip(PROMPTS, MAX_NEW, outs, strict=True):
        ids = tok.encode(prompt)
        expected = hf_greedy(hf_model, ids, max_new, eos)
        assert out["output_ids"] == expected, prompt
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == len(expected)
        if expected[-1] == eos:
            assert meta["finish_reason"] == {"type": "stop", "matched": eos}
        else:
            assert meta["finish_reason"] == {"type": "length", "length": max_new}
        assert out["text"] == tok.decode([t for t in expected if t != eos], skip_special_tokens=True)
    assert_idle_and_free(engine)


def test_single_with_input_ids_equals_text(engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    by_text = engine.generate(PROMPTS[0], greedy(12))
    by_ids = engine.generate(input_ids=ids, sampling_params=greedy(12))
    assert isinstance(by_text, dict)
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]


def test_stream_equals_non_stream(engine):
    params = greedy(30, ignore_eos=True)
    final = engine.generate(PROMPTS[4], params)
    chunks = list(engine.generate(PROMPTS[4], params, stream=True))
    assert len(chunks) > 1
    last = chunks[-1]
    assert last["text"] == final["text"] and last["output_ids"] == final["output_ids"]
    assert last["meta_info"]["finish_reason"] == final["meta_info"]["finish_reason"]
    previous = ""
    for chunk in chunks:
        assert chunk["text"].startswith(previous)
        previous = chunk["text"]
        assert chunk["meta_info"]["completion_tokens"] == len(chunk["output_ids"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_batch_stream_and_n(engine):
    outs = engine.generate(PROMPTS[:2], greedy(6, n=2))
    assert len(outs) == 4                                      # prompt-major: p0s0, p0s1, p1s0, p1s1
    assert outs[0]["output_ids"] == outs[1]["output_ids"]      # greedy samples agree
    assert outs[0]["meta_info"]["id"].endswith("-0") and outs[1]["meta_info"]["id"].endswith("-1")
    singles = [engine.generate(p, greedy(6)) for p in PROMPTS[:2]]
    assert [outs[0]["text"], outs[2]["text"]] == [s["text"] for s in singles]
    finals: dict[int, dict] = {}
    for chunk in engine.generate(PROMPTS[:2], greedy(6), stream=True):
        finals[chunk["index"]] = chunk
    assert [finals[i]["text"] for i in (0, 1)] == [s["text"] for s in singles]


def test_logprobs(engine, hf_model):
    tok = engine.tokenizer
    ids = tok.encode(PROMPTS[1])
    out = engine.generate(input_ids=ids, sampling_params=greedy(5, ignore_eos=True), return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None and [t[1] for t in inp] == ids
    assert [t[1] for t in outp] == out["output_ids"]
    assert all(isinstance(t[2], str) and t[2] for t in inp + outp)
    assert len(meta["output_top_logprobs"]) == 5 and all(len(top) == 2 for top in meta["output_top_logprobs"])
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    expected = [logp[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert [t[0] for t in inp[1:]] == pytest.approx(expected, abs=1e-3)
    plain = engine.generate(input_ids=ids, sampling_params=greedy(2), return_logprob=True)
    assert plain["meta_info"]["output_token_logprobs"][0][2] is None   # no text unless asked


def test_async_generate(engine):
    async def main() -> tuple[list[dict], list[dict]]:
        outs = await asyncio.gather(*[engine.async_generate(p, greedy(8)) for p in PROMPTS[:3]])
        chunks = [c async for c in await engine.async_generate(PROMPTS[0], greedy(8), stream=True)]
        return list(outs), chunks

    outs, chunks = asyncio.run(main())
    expected = [engine.generate(p, greedy(8))["text"] for p in PROMPTS[:3]]
    assert [o["text"] for o in outs] == expected
    assert chunks[-1]["text"] == expected[0]


def test_second_identical_prompt_hits_the_cache(engine):
    prompt = "def cached_prefix_check(alpha, beta):\n    total = alpha + beta\n    return total * 3"
    first = engine.generate(prompt, greedy(4))
    second = engine.generate(prompt, greedy(4))
    page = engine.scheduler_info["page_size"]
    meta = second["meta_info"]
    assert meta["cached_tokens"] >= meta["prompt_tokens"] - page
    assert first["meta_info"]["cached_tokens"] < meta["cached_tokens"]
    assert second["output_ids"] == first["output_ids"]


def test_abort(engine):
    rid = "abort-me"
    stream = engine.generate(PROMPTS[0], {"max_new_tokens": 1500, "ignore_eos": True}, stream=True, rid=rid)
    first = next(stream)
    assert first["meta_info"]["id"] == rid
    engine.abort_request(rid)
    rest = list(stream)
    assert rest and rest[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert rest[-1]["meta_info"]["completion_tokens"] < 1500
    # closing a stream early aborts its request too
    closed = engine.generate(PROMPTS[1], {"max_new_tokens": 1500, "ignore_eos": True}, stream=True)
    next(closed)
    closed.close()
    deadline = time.monotonic() + 10
    while engine.get_server_info()["internal_states"][0]["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_idle_and_free(engine)


def test_client_disconnect_aborts(engine, monkeypatch):
    """The HTTP path: `generate(obj, request)` polls `request.is_disconnected()` and aborts. The poll
    is shortened to 10 ms: at the default 1 s the tiny model finished all 1,900 tokens first on a
    Zen 5 EPYC, so the test depended on the machine's speed."""
    from radixlm.runtime.managers import tokenizer_manager
    from radixlm.runtime.managers.io_struct import GenerateReqInput

    monkeypatch.setattr(tokenizer_manager, "DISCONNECT_POLL_S", 0.01)

    class GoneClient:
        async def is_disconnected(self) -> bool:
            return True

    async def consume() -> dict:
        obj = GenerateReqInput(text=PROMPTS[0], sampling_params={"max_new_tokens": 1900, "ignore_eos": True})
        results = [item async for item in engine.tokenizer_manager.generate(obj, GoneClient())]
        return results[-1]

    out = engine._core.call(consume())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 1900
    assert_idle_and_free(engine)


def test_prefill_only(engine):
    out = engine.generate(PROMPTS[3], {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == [] and meta["completion_tokens"] == 0
    assert meta["finish_reason"]["type"] == "length"
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]


class RecordingMetrics:
    """Stands in for runtime.metrics.MetricsCollector and records the hook calls."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.finished: list[tuple] = []
        self.stats: list = []

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.append(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.append(seconds)

    def on_request_finished(self, prompt_tokens: int, completion_tokens: int, e2e_seconds: float,
                            aborted: bool) -> None:
        self.finished.append((prompt_tokens, completion_tokens, e2e_seconds, aborted))

    def update_scheduler_stats(self, stats) -> None:
        self.stats.append(stats)


def test_metrics_hooks(engine):
    tm = engine.tokenizer_manager
    rec = RecordingMetrics()
    tm.metrics = rec
    try:
        chunks = list(engine.generate(PROMPTS[0], greedy(10, ignore_eos=True), stream=True))
        deadline = time.monotonic() + 5
        while not rec.stats and time.monotonic() < deadline:     # stats are pushed as it goes idle
            time.sleep(0.05)
    finally:
        tm.metrics = None
    meta = chunks[-1]["meta_info"]
    assert len(rec.ttft) == 1 and 0 < rec.ttft[0] <= meta["e2e_latency"]
    assert len(rec.itl) == 9 and all(gap >= 0 for gap in rec.itl)
    assert len(rec.finished) == 1
    prompt_tokens, completion_tokens, e2e, aborted = rec.finished[0]
    assert (prompt_tokens, completion_tokens, aborted) == (meta["prompt_tokens"], 10, False) and e2e > 0
    assert rec.stats and tm.latest_stats is rec.stats[-1]


def test_flush_cache_and_server_info(engine):
    assert engine.flush_cache().success
    info = engine.get_server_info()
    assert info["model_path"] == engine.server_args.model_path
    assert info["context_len"] == engine.tokenizer_manager.context_len
    assert info["internal_states"][0]["radix_tree_tokens"] == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=""), "empty"),
    (dict(input_ids=[]), "empty"),
    (dict(input_ids=[1, 5, 999999]), "999999"),
    (dict(input_ids=[7] * 2100), "context length"),
    (dict(prompt="hi", sampling_params={"max_new_tokens": 2048}), "context length"),
    (dict(prompt="hi", sampling_params={"temperature": -1}), "temperature"),
    (dict(prompt="hi", sampling_params={"bogus": 1}), "bogus"),
    (dict(prompt=["a", "b"], sampling_params=[{}, {}, {}]), "one entry per prompt"),
    (dict(prompt="hi", input_ids=[1, 2]), "Exactly one"),
    (dict(prompt="hi", sampling_params={"logit_bias": {"5000": 1.0}}), "out of range"),
])
def test_bad_input_raises_value_error(engine, kwargs: dict, message: str):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    assert engine.tokenizer_manager.num_running_requests() == 0


def test_idle_engine_uses_almost_no_cpu(engine):
    engine.generate(PROMPTS[0], greedy(4))          # then go idle
    time.sleep(1.0)
    pids = [p.pid for p in engine.subprocesses.processes.values()]
    before = sum(process_cpu_seconds(pid) for pid in pids)
    time.sleep(10.0)
    used = sum(process_cpu_seconds(pid) for pid in pids) - before
    assert used < 0.5, f"children used {used:.2f} CPU-seconds in 10 s of idling"


def process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


# ------------------------------------------------------------------ failures
def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def test_bad_model_path_is_refused_before_any_child_starts(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        radixlm.Engine(model_path=str(tmp_path / "no-such-model"))


def test_startup_failure_raises_the_child_error(tmp_path, llama_path):
    import shutil

    broken = tmp_path / "no-weights"
    shutil.copytree(llama_path, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()                      # config.json is fine (preflight passes); loading fails in the child
    with pytest.raises(RuntimeError, match="failed to start"):
        radixlm.Engine(model_path=str(broken))


@pytest.mark.parametrize("victim", ["scheduler", pytest.param("detokenizer", marks=pytest.mark.slow)])
def test_killing_a_child_fails_pending_requests(llama_path: str, victim: str):
    eng = radixlm.Engine(model_path=llama_path, max_total_tokens=8192)
    procs = eng.subprocesses.processes
    pids = [p.pid for p in procs.values()]
    victim_pid = next(p.pid for name, p in procs.items() if name.startswith(victim))
    errors: list[BaseException] = []

    def background() -> None:
        try:
            eng.generate(PROMPTS[1], {"max_new_tokens": 2000, "ignore_eos": True})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    waiter = threading.Thread(target=background)
    stream = eng.generate(PROMPTS[0], {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
    next(stream)
    waiter.start()
    os.kill(victim_pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        list(stream)
    waiter.join(10)
    assert time.monotonic() - start < 5.0
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert wait_gone(pids, 5.0) == []                 # the other children are gone too: no orphan
    assert not eng.is_running
    with pytest.raises(RuntimeError):
        eng.generate("hi")
    eng.shutdown()


@pytest.mark.slow
def test_children_die_with_a_killed_parent(llama_path: str, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, radixlm
        if __name__ == "__main__":
            eng = radixlm.Engine(model_path={llama_path!r}, max_total_tokens=4096)
            print(eng.subprocesses.port_args.ipc_dir, flush=True)
            print(" ".join(str(p.pid) for p in eng.subprocesses.processes.values()), flush=True)
            time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ipc_dir = parent.stdout.readline().strip()
        pids = [int(x) for x in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(pids, 5.0) == []
    shutil.rmtree(ipc_dir, ignore_errors=True)        # the killed parent could not remove it
