"""DSL additions for agents against the real server: `separate_reasoning`, `gen(n > 1)`, `s.copy()`.

The tiny random model cannot think on its own, so outputs are shaped with `regex`."""

from __future__ import annotations

import pytest

import radixlm.api as sgl
from tests.server_fixtures import ServerProcess, start_server

SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "1024", "--max-total-tokens", "16384")


@pytest.fixture(scope="module")
def server(qwen2_path: str):
    srv = start_server(qwen2_path, *SERVER_FLAGS, timeout=600)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def backend(server: ServerProcess):
    endpoint = sgl.RuntimeEndpoint(server.base_url)
    yield endpoint
    endpoint.close()


def test_separate_reasoning(backend) -> None:
    @sgl.function
    def think(s, model_type, regex):
        s += "Q: 2+2?\nA: "
        s += sgl.separate_reasoning(sgl.gen("answer", max_tokens=32, regex=regex), model_type=model_type)

    state = think.run(model_type="qwen3", regex="<think>two and two</think>\n\nfour", backend=backend)
    assert state["answer"] == "four" and state["answer_reasoning_content"] == "two and two"
    assert state.text().endswith("<think>two and two</think>\n\nfour")   # the prompt keeps what was generated
    state = think.run(model_type="deepseek-r1", regex="sum</think>4", backend=backend)
    assert (state["answer_reasoning_content"], state["answer"]) == ("sum", "4")
    state = think.run(model_type="qwen3", regex="no thoughts", backend=backend)
    assert (state["answer_reasoning_content"], state["answer"]) == ("", "no thoughts")


def test_gen_n_returns_a_list(backend) -> None:
    @sgl.function
    def many(s):
        s += "Pick a digit: "
        s += sgl.gen("digit", n=3, max_tokens=4, regex="[0-9]", temperature=1.0)
        s += sgl.separate_reasoning(sgl.gen("why", n=2, max_tokens=16, regex="<think>x</think>[ab]"), "qwen3")

    state = many.run(backend=backend)
    digits = state["digit"]
    assert isinstance(digits, list) and len(digits) == 3 and all(d.isdigit() for d in digits)
    assert len(state.get_meta_info("digit")) == 3
    assert state["why"] in (["a", "a"], ["a", "b"], ["b", "a"], ["b", "b"])
    assert state["why_reasoning_content"] == ["x", "x"]
    assert state.text().startswith("Pick a digit: " + digits[0] + "<think>x</think>")


def test_copy_is_independent(backend) -> None:
    @sgl.function
    def branch(s):
        s += "Base text. "
        s += sgl.gen("first", max_tokens=3, regex="[a-z]{3}")
        other = s.copy()
        other += " Copy: " + sgl.gen("second", max_tokens=3, regex="[0-9]{2}")
        s += " Original."
        return other

    state = branch.run(backend=backend)
    other = state.ret_value
    assert other["first"] == state["first"]
    assert other.text() == "Base text. " + state["first"] + " Copy: " + other["second"]
    assert state.text() == "Base text. " + state["first"] + " Original."
    assert "second" not in state


def test_separate_reasoning_errors() -> None:
    with pytest.raises(ValueError, match="named gen"):
        sgl.separate_reasoning(sgl.gen(max_tokens=4))
    with pytest.raises(ValueError, match="qwen3"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="nope")
