"""SGLang's own client code, unmodified, against a radixlm server (tiny llama, CPU).

Needs the `sglang` package (`pip install --no-deps sglang` plus psutil, pybase64, aiohttp): skipped
without it. Covers the `@function` frontend (gen with stop / stop_regex / regex / choices / json via
regex, select, fork, streaming) and SGLang's server-agnostic regex test kit.
"""

from __future__ import annotations

import re
import unittest

import pytest

from tests.server_fixtures import ServerProcess, start_server, wait_kv_free

try:
    import sglang as sgl
    from sglang.test.kits.regex_constrained_kit import RegexConstrainedMixin
except Exception as e:  # noqa: BLE001 - missing package or one of the modules its frontend imports
    pytest.skip(f"sglang frontend not importable: {e}", allow_module_level=True)

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
