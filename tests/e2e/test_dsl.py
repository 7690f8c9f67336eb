"""The DSL against the real server (tiny llama, CPU): multi-turn roles, select scores, fork and the
prefix cache, streaming, run_batch's shared-prefix prefill, errors, the OpenAI backend, Runtime.

One server serves the module; the Runtime test starts (and stops) its own. Tests that use
constrained decoding come last, so that a grammar failure cannot take the others down with it.
"""

from __future__ import annotations

import asyncio
import re
import time
import warnings

import httpx
import pytest

import radixlm.api as sgl
from radixlm.frontend_lang.ir import REGEX_INT
from radixlm.frontend_lang.lint import PrefixCacheLintWarning
from tests.server_fixtures import ServerProcess, descendant_pids, metric_values, pid_alive, server_fixture

SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "2048", "--max-total-tokens", "32768")
SYSTEM_SENTENCE = "You answer questions about the Python standard library, citing the module name. "


server = server_fixture(*SERVER_FLAGS)


@pytest.fixture(scope="module")
def backend(server: ServerProcess):
    endpoint = sgl.RuntimeEndpoint(server.base_url)
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="module")
def tokenizer(llama_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_path)


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


def settled_metrics(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once the prefix-cache counters stop moving (the scheduler pushes stats periodically)."""
    last = metric_values(server)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = metric_values(server)
        if now.get("radixlm:prefix_cache_queries_total") == last.get("radixlm:prefix_cache_queries_total"):
            return now
        last = now
    return last


def metrics_when(server: ServerProcess, done, timeout: float = 10.0) -> dict[str, float]:
    """/metrics as soon as `done(values)` holds (or at the timeout): the counters arrive with a lag."""
    deadline = time.monotonic() + timeout
    values = metric_values(server)
    while not done(values) and time.monotonic() < deadline:
        time.sleep(0.3)
        values = metric_values(server)
    return values


def direct_logprobs(server: ServerProcess, texts: list[str]) -> list[dict]:
    body = {"text": texts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "return_text_in_logprobs": True}
    r = httpx.post(server.url("/generate"), json=body, timeout=60)
    r.raise_for_status()
    return [item["meta_info"]["input_token_logprobs"] for item in r.json()]


# ------------------------------------------------------------------- multi-turn
@sgl.function
def two_turns(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("first", max_tokens=6))
    s += sgl.user("And then?")
    with s.assistant():
        s += sgl.gen("second", max_tokens=6)


def test_multi_turn_messages_and_template(backend, tokenizer):
    assert backend.get_chat_template().name == "chatml"  # read from the tiny tokenizer's template
    state = two_turns.run(question="What is os.path?", temperature=0, backend=backend)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["first"] and messages[4]["content"] == state["second"]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert state.text() == rendered
    meta = state.get_meta_info("second")
    assert meta["completion_tokens"] <= 6 and meta["prompt_tokens"] > 0


# ------------------------------------------------------------------------ select
@sgl.function
def pick(s):
    s += "def add(a, b):\n    return"
    s += sgl.select("body", choices=[" a + b", "a+b", " None", " add(a, b)"])
    s += "\n"


def test_select_scores_equal_direct_logprobs(backend, server):
    state = pick.run(temperature=0, backend=backend)
    choices = [" a + b", "a+b", " None", " add(a, b)"]
    meta = state.get_meta_info("body")
    scores = meta["normalized_prompt_logprobs"]
    assert state["body"] in choices and state["body"] == choices[max(range(4), key=lambda i: scores[i])]
    prompt = "def add(a, b):\n    return"
    direct = direct_logprobs(server, [prompt] + [prompt + c for c in choices])
    prompt_ids = [e[1] for e in direct[0]]
    for i, entries in enumerate(direct[1:]):
        ids = [e[1] for e in entries]
        split = next(j for j in range(len(ids)) if j >= len(prompt_ids) or ids[j] != prompt_ids[j])
        expected = [e[0] for e in entries[split:]]
        assert [e[1] for e in meta["input_token_logprobs"][i]] == ids[split:]
        assert scores[i] == pytest.approx(sum(expected) / len(expected), abs=2e-3)


# --------------------------------------------------------------------------- fork
LONG_PREFIX = "import os\nimport sys\nfrom pathlib import Path\n" * 12


@sgl.function
def three_ways(s):
    s += LONG_PREFIX
    forks = s.fork(3)
    for i, branch in enumerate(forks):
        branch += f"# variant {i}\n" + sgl.gen("code", max_tokens=4)
    forks.join()
    s += "# chosen:" + s["code"][0]


def test_fork_computes_the_prefix_once(backend, server, tokenizer):
    backend.flush_cache()
    state = three_ways.run(temperature=0, backend=backend)
    assert isinstance(state["code"], list) and len(state["code"]) == 3
    assert state.text() == LONG_PREFIX + "# chosen:" + state["code"][0]
    prefix_tokens = token_count(tokenizer, LONG_PREFIX)
    branches = state.stream_executor.children
    for i, child in enumerate(branches):
        meta = child.meta_info["code"]
        assert meta["cached_tokens"] >= prefix_tokens - 2, (i, meta, prefix_tokens)
        assert child.text_.startswith(LONG_PREFIX + f"# variant {i}\n")


# ----------------------------------------------------------------------- streaming
def test_text_iter_streaming_equals_non_streamed(backend):
    plain = two_turns.run(question="Name a module.", temperature=0, max_new_tokens=8, backend=backend)
    streamed = two_turns.run(question="Name a module.", temperature=0, max_new_tokens=8, stream=True,
                             backend=backend)
    pieces = list(streamed.text_iter())
    assert len(pieces) > 2
    assert "".join(pieces) == plain.text()
    again = two_turns.run(question="Name a module.", temperature=0, stream=True, backend=backend)
    assert "".join(again.text_iter("second")) == plain["second"]

    async def collect() -> tuple[str, sgl.ProgramState]:
        state = two_turns.run(question="Name a module.", temperature=0, stream=True, backend=backend)
        return "".join([piece async for piece in state.text_async_iter("first")]), state

    first, state = asyncio.run(collect())
    assert first == plain["first"]
    assert state.text() == plain.text()  # the rest of the program keeps running after "first"


# ----------------------------------------------------------------------- run_batch
def long_system_prompt(tokenizer, min_tokens: int = 500) -> str:
    text = ""
    while token_count(tokenizer, text) < min_tokens:
        text += SYSTEM_SENTENCE
    return text


def test_run_batch_prefills_the_shared_prefix_once(backend, server, tokenizer, capsys):
    system_prompt = long_system_prompt(tokenizer)

    @sgl.function
    def ask(s, question):
        s += sgl.system(system_prompt)
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=2))

    shared_tokens = token_count(tokenizer, f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
    assert shared_tokens >= 500
    backend.flush_cache()
    before = settled_metrics(server)
    questions = [{"question": f"What does module number {i} do?"} for i in range(32)]
    states = ask.run_batch(questions, temperature=0, backend=backend, progress_bar=True)
    assert all(s.error() is None for s in states) and len(states) == 32
    cached = [s.get_meta_info("answer")["cached_tokens"] for s in states]
    assert min(cached) >= shared_tokens - 2, cached
    hits_key, queries_key = "radixlm:prefix_cache_hits_total", "radixlm:prefix_cache_queries_total"
    expected_hits = 32 * (shared_tokens - 2)
    after = metrics_when(server, lambda v: v[hits_key] - before[hits_key] >= expected_hits)
    hits = after[hits_key] - before[hits_key]
    queries = after[queries_key] - before[queries_key]
    computed = queries - hits
    assert hits >= expected_hits, (hits, expected_hits)
    assert computed < 2 * shared_tokens + 32 * 30, (queries, hits)  # prefilled once, not 32 times
    assert "32/32" in capsys.readouterr().err


def test_run_batch_lint_warns_only_for_a_dynamic_prefix(backend, tokenizer):
    system_prompt = long_system_prompt(tokenizer, 100)

    @sgl.function
    def stamped(s, now, question):
        s += sgl.system(f"Current time: {now}. " + system_prompt)
        s += sgl.user(question) + sgl.assistant(sgl.gen("a", max_tokens=1))

    @sgl.function
    def friendly(s, now, question):
        s += sgl.system(system_prompt)
        s += sgl.user(f"Current time: {now}. {question}") + sgl.assistant(sgl.gen("a", max_tokens=1))

    batch = [{"now": f"12:0{i}", "question": "Which module handles paths?"} for i in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        friendly.run_batch(batch, temperature=0, backend=backend)
        assert not [w for w in caught if issubclass(w.category, PrefixCacheLintWarning)]
        stamped.run_batch(batch, temperature=0, backend=backend)
    lint = [str(w.message) for w in caught if issubclass(w.category, PrefixCacheLintWarning)]
    assert len(lint) == 1 and "'stamped'" in lint[0] and "'now'" in lint[0]


# -------------------------------------------------------------------------- errors
def test_server_errors_surface_with_the_server_message(backend):
    with pytest.raises(sgl.BackendError, match="temperature must be >= 0") as info:
        two_turns.run(question="x", temperature=-1.0, backend=backend)
    assert info.value.status_code == 400
    states = two_turns.run_batch([{"question": "x"}], temperature=-1.0, backend=backend)
    assert isinstance(states[0].error(), sgl.BackendError)
    with pytest.raises(sgl.BackendError):
        states[0]["first"]


# --------------------------------------------------------------------- OpenAI backend
@sgl.function
def chat_once(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))
    s += sgl.user("Pick one.")
    s += sgl.assistant(sgl.select("pick", choices=["os", "sys"]))


def test_openai_backend_generates_like_the_native_one(server, backend):
    info = server.get_json("/get_model_info")
    openai_backend = sgl.OpenAI(info["served_model_name"], base_url=server.url("/v1"), chat_template="chatml")
    via_openai = chat_once.run(question="Which module?", temperature=0, backend=openai_backend)
    native = chat_once.run(question="Which module?", temperature=0, backend=backend)
    assert via_openai["answer"] == native["answer"]
    assert via_openai["pick"] in ("os", "sys")
    assert via_openai.get_meta_info("pick")["method"] == "generate_and_match"
    with pytest.raises(ValueError, match="assistant turn"):
        pick.run(backend=openai_backend)


# --------------------------------------------------------------------------- Runtime
def test_runtime_starts_runs_and_leaves_no_process(llama_path):
    runtime = sgl.Runtime(model_path=llama_path, device="cpu", dtype="float32", context_length=512,
                          max_total_tokens=4096)
    try:
        state = two_turns.run(question="hi", temperature=0, max_new_tokens=2, backend=runtime)
        assert len(state.messages()) == 5
        pids = [runtime.pid, *descendant_pids(runtime.pid)]
        assert len(pids) >= 2  # the server and its scheduler/detokenizer children
        url = runtime.url
    finally:
        runtime.shutdown()
    assert not [p for p in pids if pid_alive(p)]
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
    runtime.shutdown()  # twice is fine


# ------------------------------------------------------------ constrained decoding
@sgl.function
def typed(s):
    s += "Answer: "
    s += sgl.gen("code", regex=r"[a-z]{3}-[0-9]{2}", max_tokens=12)
    s += "\nCount: " + sgl.gen("n", dtype=int, max_tokens=6)
    s += "\nOther: " + sgl.gen_int("m", max_tokens=6)


def test_gen_regex_and_dtype_int(backend):
    state = typed.run(temperature=0, backend=backend)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", state["code"]), state["code"]
    assert re.fullmatch(REGEX_INT, state["n"]) and isinstance(int(state["n"]), int), state["n"]
    assert re.fullmatch(REGEX_INT, state["m"]), state["m"]
