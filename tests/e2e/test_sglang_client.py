"""SGLang's own client code, unmodified, against a radixlm server (tiny llama, CPU).

Needs the `sglang` package (`pip install --no-deps sglang` plus the modules listed in benchmarks/README.md,
"SGLang's own client"): skipped without it. Covers the `@function` frontend (gen with stop / stop_regex /
regex / choices / json via regex, select, fork, streaming), SGLang's server-agnostic regex test kit, and
a short `sglang.bench_serving --backend sglang` run (benchmarks/sglang_bench_serving.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unittest
from pathlib import Path

import pytest

from tests.helpers import missing_dependency
from tests.real_model import smollm2_gguf
from tests.server_fixtures import ServerProcess, server_fixture, start_server, wait_kv_free

try:
    import sglang as sgl
    from sglang.test.kits.regex_constrained_kit import RegexConstrainedMixin
except Exception as e:  # noqa: BLE001 - missing package or one of the modules its frontend imports
    missing_dependency(f"sglang frontend not importable (pip install --no-deps -r tests/sglang_client.txt): {e}")

BENCH_RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_bench_serving.py"
FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "1024", "--max-total-tokens", "16384")


@pytest.fixture(scope="module")
def server(llama_path: str):
    srv = start_server(llama_path, *FLAGS)
    sgl.set_default_backend(sgl.RuntimeEndpoint(srv.base_url))
    yield srv
    srv.stop()


@sgl.function
def profile(s, name):
    s += "Name: " + name + "\n"
    s += "Age: " + sgl.gen("age", max_tokens=8, regex=r"[1-9][0-9]?", temperature=0) + "\n"
    s += "Mood: " + sgl.gen("mood", choices=["happy", "sad", "calm"]) + "\n"
    s += "Pet: " + sgl.select("pet", choices=["cat", "dog"]) + "\n"
    s += "Bio: " + sgl.gen("bio", max_tokens=16, stop=["\n", "."], temperature=0) + "\n"
    s += "Data: " + sgl.gen("data", max_tokens=40, regex=r'\{"id": [0-9]{1,3}, "ok": (true|false)\}',
                            temperature=0)
    s += "Tail: " + sgl.gen("tail", max_tokens=24, regex=r"[a-z]{2,6} [0-9]{4} [a-z]+", stop_regex=r"[0-9]{4}",
                            temperature=0)


@sgl.function
def branches(s):
    s += "Options:"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" {i}: " + sgl.gen("x", max_tokens=6, regex=r"[a-z]{3,5}", temperature=0.8)
    forks.join()
    s += " chosen: " + sgl.gen("pick", max_tokens=4, regex=r"(yes|no)")


def test_function_gen_select_choices_regex_stop_regex(server: ServerProcess) -> None:
    state = profile.run(name="Ada")
    assert re.fullmatch(r"[1-9][0-9]?", state["age"])
    assert state["mood"] in ("happy", "sad", "calm") and state["pet"] in ("cat", "dog")
    assert "\n" not in state["bio"] and "." not in state["bio"]
    assert re.fullmatch(r'\{"id": [0-9]{1,3}, "ok": (true|false)\}', state["data"])
    assert re.fullmatch(r"[a-z]{2,6} ", state["tail"]), state["tail"]   # stopped at the 4 digits, trimmed
    assert state.get_meta_info("tail")["finish_reason"]["matched"] == r"[0-9]{4}"
    wait_kv_free(server)


def test_fork_and_streaming(server: ServerProcess) -> None:
    state = branches.run()
    assert re.fullmatch(r"(yes|no)", state["pick"])
    streamed = branches.run(stream=True)
    chunks = list(streamed.text_iter())
    assert "".join(chunks) == streamed.text() and len(chunks) > 1
    assert re.fullmatch(r"(yes|no)", streamed["pick"])


def test_bench_serving_sglang_backend(server: ServerProcess, llama_path: str, tmp_path: Path) -> None:
    """SGLang's benchmark client, native /generate streamed with ignore_eos: every request succeeds and
    the token counts it reads from each chunk's meta_info add up exactly."""
    out = tmp_path / "bench.jsonl"
    num_prompts, input_len, output_len = 6, 32, 8
    cmd = [sys.executable, str(BENCH_RUNNER), "--backend", "sglang", "--base-url", server.base_url,
           "--dataset-name", "random-ids", "--random-range-ratio", "1.0", "--num-prompts", str(num_prompts),
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--max-concurrency", "3", "--tokenizer", llama_path, "--seed", "1", "--disable-tqdm",
           "--output-file", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == num_prompts, proc.stdout[-3000:]
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["total_input_tokens"] == num_prompts * input_len
    wait_kv_free(server)


@pytest.fixture
def kit_url(request: pytest.FixtureRequest, server: ServerProcess) -> None:
    request.cls.base_url = server.base_url


@pytest.mark.usefixtures("kit_url")
class TestRegexKit(RegexConstrainedMixin, unittest.TestCase):
    """SGLang's regex kit as is (anchored patterns, n=3, logprobs)."""

    # Unbounded patterns (`\s*`, `[a-z]+`) are not closed by random weights within the kit's 128 tokens;
    # these two pass against a real model (SmolLM2-135M), see the issue-15 report.
    def test_regex_generate_complex_json(self):
        pytest.skip("random weights do not close this unbounded pattern within 128 tokens")

    def test_regex_generate_custom_log_format(self):
        pytest.skip("random weights do not close this unbounded pattern within 128 tokens")


real_server = server_fixture("--dtype", "bfloat16", "--context-length", "2048", "--max-total-tokens", "8192",
                             model=smollm2_gguf, timeout=900)


@pytest.fixture
def real_kit_url(request: pytest.FixtureRequest, real_server: ServerProcess) -> None:
    request.cls.base_url = real_server.base_url


@pytest.mark.slow
@pytest.mark.usefixtures("real_kit_url")
class TestRegexKitRealModel(RegexConstrainedMixin, unittest.TestCase):
    """The whole regex kit, unbounded patterns included, on SmolLM2-135M-Instruct (bf16).

    SGLang's JSON kit is not run here: on this 135M model it fails on vLLM's CPU server too (the
    model loops inside the name string or the integer until max_new_tokens); see the issue-15 note."""
