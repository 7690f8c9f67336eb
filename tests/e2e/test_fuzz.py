"""Fuzzing the real server: no input, valid or not, may produce a 5xx or bring the server down.

Two fuzzers, against one server (tiny llama, CPU, loopback only):
  * schemathesis reads the server's own `/openapi.json` and generates requests for every native
    and OpenAI route, both schema-conforming (positive) and schema-violating (negative) ones;
  * a hypothesis strategy builds JSON bodies for `/generate`, `/v1/chat/completions` and
    `/v1/completions` that mix known field names with random values of any JSON type, so that the
    requests get past the pydantic layer into SamplingParams, the TokenizerManager and the scheduler.

Every response must be < 500; afterwards /health_generate works and no KV slot or req row leaked.
The server runs with `--request-timeout 3`, which bounds the cost of a fuzzed request that asks
for a long generation (the timeout is an abort, reported with 200, never a 5xx). CI mode runs a
few hundred cases; `--runslow` runs several thousand.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.server_fixtures import ServerProcess, server_fixture, wait_kv_free

SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "128", "--max-total-tokens", "4096",
                "--request-timeout", "3", "--max-request-bytes", "262144")
# one torch thread in the scheduler: on a shared 2-core machine two spinning OpenMP threads make a
# tiny model's decode step up to 100x slower (MACHINE_FACTS.md, Noise)
ONE_THREAD = {"RADIXLM_NUM_THREADS": "1"}
CI_EXAMPLES = 25            # per route and generation mode (schemathesis)
SLOW_EXAMPLES = 150
CI_RANDOM_JSON = 100        # per route (hypothesis)
SLOW_RANDOM_JSON = 800
CLIENT_TIMEOUT = 60.0
FUZZ_SETTINGS = dict(deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


server = server_fixture(*SERVER_FLAGS, env=ONE_THREAD, clean_exit=True)


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> Any:
    raw = httpx.get(server.url("/openapi.json"), timeout=30).json()
    return schemathesis.openapi.from_dict(raw)


class Tally:
    """Status codes seen, and the first few 5xx (request and response) for the failure message."""

    def __init__(self) -> None:
        self.codes: Counter[int] = Counter()
        self.failures: list[str] = []

    def record(self, what: str, status: int, text: str) -> None:
        self.codes[status] += 1
        if status >= 500 and len(self.failures) < 5:
            self.failures.append(f"{status} for {what}: {text[:300]}")

    @property
    def cases(self) -> int:
        return sum(self.codes.values())


def _check_healthy(server: ServerProcess) -> None:
    assert server.alive(), f"the server died:\n{server.log_tail()}"
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200
    assert httpx.get(server.url("/health_generate"), timeout=60).status_code == 200
    wait_kv_free(server, timeout=30)


# ---------------------------------------------------------------------- schemathesis
def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


def _fuzz_operation(op: Any, mode: GenerationMode, base_url: str, examples: int, tally: Tally,
                    session: Any) -> None:
    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, session=session, timeout=CLIENT_TIMEOUT)
        tally.record(f"{op.label} {mode.value} body={case.body!r:.300}", response.status_code, response.text)

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise   # a route without parameters has no negative cases; every route has positive ones


def _run_schemathesis(server: ServerProcess, api_schema: Any, examples: int) -> Tally:
    import requests

    tally = Tally()
    ops = _operations(api_schema)
    labels = {op.label for op in ops}
    for must in ("POST /generate", "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"):
        assert must in labels, sorted(labels)
    started = time.monotonic()
    with requests.Session() as session:
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz_operation(op, mode, server.base_url, examples, tally, session)
    print(f"\nschemathesis: {tally.cases} cases over {len(ops)} operations in {time.monotonic() - started:.1f} s, "
          f"status codes {dict(sorted(tally.codes.items()))}")
    return tally


def test_schemathesis_no_server_errors(server: ServerProcess, api_schema: Any) -> None:
    tally = _run_schemathesis(server, api_schema, CI_EXAMPLES)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.cases >= 100
    _check_healthy(server)


@pytest.mark.slow
def test_schemathesis_no_server_errors_long(server: ServerProcess, api_schema: Any) -> None:
    tally = _run_schemathesis(server, api_schema, SLOW_EXAMPLES)
    assert not tally.failures, "\n".join(tally.failures)
    _check_healthy(server)


# ---------------------------------------------------------------------- random JSON
JSON_SCALARS = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | \
    st.text(max_size=24)
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
# values that are plausible for many fields, so that most cases get past the schema into deep validation
NEAR_VALID = st.sampled_from([0, 1, 2, 3, -1, 0.0, 0.5, 1.5, 100000, 10**400, float("inf"), float("nan"), "", "a",
                              "[a-z]{3}", '{"type": "object"}', ["x"], [1, 2], {"5": 1.0}, {"type": "json_object"},
                              True, False, None])
SAMPLING_KEYS = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
                 "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n",
                 "regex", "json_schema", "ebnf", "logit_bias", "sampling_seed")
GENERATE_KEYS = ("rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                 "stream", "priority", "timeout")
CHAT_KEYS = ("max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop", "temperature",
             "top_p", "logprobs", "top_logprobs", "seed", "response_format", "logit_bias", "regex", "json_schema",
             "ignore_eos", "top_k", "min_p", "frequency_penalty", "presence_penalty", "tools", "model")


def _mostly(good: st.SearchStrategy) -> st.SearchStrategy:
    """`good` seven times in eight, any JSON value otherwise."""
    return st.integers(0, 7).flatmap(lambda k: ANY_JSON if k == 0 else good)


def _fields(keys: tuple[str, ...], max_size: int) -> st.SearchStrategy[dict[str, Any]]:
    """A few fields: mostly known names with plausible values, sometimes unknown names."""
    return st.dictionaries(_mostly(st.sampled_from(keys)).map(str), _mostly(NEAR_VALID), max_size=max_size)


def _generate_body() -> st.SearchStrategy[dict[str, Any]]:
    text = st.text(min_size=1, max_size=40)
    prompt = st.one_of(
        st.fixed_dictionaries({"text": text}),
        st.fixed_dictionaries({"text": st.lists(text, min_size=1, max_size=3)}),
        st.fixed_dictionaries({"input_ids": st.lists(st.integers(-2, 2001), min_size=1, max_size=12)}),
        st.fixed_dictionaries({"input_ids": st.lists(st.lists(st.integers(0, 2001), min_size=1, max_size=6),
                                                     min_size=1, max_size=3)}),
        st.fixed_dictionaries({}, optional={"text": ANY_JSON, "input_ids": ANY_JSON}))
    sampling = _mostly(_fields(SAMPLING_KEYS, 4).map(lambda sp: {"max_new_tokens": 4, **sp}))
    return st.tuples(prompt, sampling, _fields(GENERATE_KEYS, 3)).map(
        lambda t: {**t[2], **t[0], "sampling_params": t[1]})


def _chat_body() -> st.SearchStrategy[dict[str, Any]]:
    role = _mostly(st.sampled_from(["system", "user", "assistant", "developer", "tool", ""]))
    content = _mostly(st.text(max_size=40) | st.sampled_from(["<|im_start|>system\nx", "<|im_end|>", "<|endoftext|>"])
                      | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                        "text": _mostly(st.text(max_size=10))}), max_size=2))
    message = _mostly(st.fixed_dictionaries({"role": role, "content": content}))
    return st.tuples(_mostly(st.lists(message, min_size=1, max_size=3)), _fields(CHAT_KEYS, 4), st.integers(0, 6)).map(
        lambda t: {"messages": t[0], "max_tokens": t[2], **t[1]})


def _completion_body() -> st.SearchStrategy[dict[str, Any]]:
    ids = st.lists(st.integers(-3, 2003) | st.integers(-2**63, 2**63), min_size=1, max_size=8)
    prompt = _mostly(st.text(min_size=1, max_size=30) | ids | st.lists(ids, min_size=1, max_size=3)
                     | st.lists(st.text(max_size=10), min_size=1, max_size=3))
    keys = ("max_tokens", "n", "stream", "echo", "logprobs", "stop", "temperature", "seed", "suffix", "best_of",
            "regex", "ignore_eos", "stream_options", "model")
    return st.tuples(prompt, _fields(keys, 4), st.integers(0, 6)).map(
        lambda t: {"prompt": t[0], "max_tokens": t[2], **t[1]})


def _post_random(server: ServerProcess, path: str, bodies: st.SearchStrategy, examples: int, tally: Tally) -> None:
    with httpx.Client(timeout=CLIENT_TIMEOUT) as client:
        @settings(max_examples=examples, **FUZZ_SETTINGS)
        @given(body=bodies)
        def run(body: Any) -> None:
            content = json.dumps(body)
            r = client.post(server.url(path), content=content, headers={"Content-Type": "application/json"})
            tally.record(f"{path} {content[:300]}", r.status_code, r.text)

        run()


def _run_random_json(server: ServerProcess, examples: int) -> Tally:
    tally = Tally()
    _post_random(server, "/generate", _generate_body(), examples, tally)
    _post_random(server, "/v1/chat/completions", _chat_body(), examples, tally)
    _post_random(server, "/v1/completions", _completion_body(), examples, tally)
    print(f"\nrandom JSON: {tally.cases} cases, status codes {dict(sorted(tally.codes.items()))}")
    return tally


def test_random_json_no_server_errors(server: ServerProcess) -> None:
    tally = _run_random_json(server, CI_RANDOM_JSON)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.codes[200] >= tally.cases // 10, "few fuzzed requests were valid: the strategy is off"
    assert sum(n for code, n in tally.codes.items() if 400 <= code < 500) > 0
    _check_healthy(server)


@pytest.mark.slow
def test_random_json_no_server_errors_long(server: ServerProcess) -> None:
    tally = _run_random_json(server, SLOW_RANDOM_JSON)
    assert not tally.failures, "\n".join(tally.failures)
    _check_healthy(server)


# ---------------------------------------------------------------------- regressions the fuzzers found
@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ids", [[7653120784172, 5753], [5, -1], [2000]])
def test_completions_out_of_vocab_ids_are_400(server: ServerProcess, ids: list[int], echo: bool,
                                              stream: bool) -> None:
    """/v1/completions decoded token-id prompts (for echo) before they were validated: an id
    outside the vocabulary raised OverflowError -> 500. Now the TokenizerManager checks them first."""
    body = {"model": "m", "prompt": ids, "max_tokens": 2, "echo": echo, "stream": stream}
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 400, r.text
    assert "token id" in r.json()["error"]["message"]


NUMERIC_SAMPLING = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "n")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400],
                         ids=["nan", "inf", "-inf", "1e400", "400-digit-int"])
def test_non_finite_numbers_are_400(server: ServerProcess, literal: str) -> None:
    """Python's JSON parser accepts NaN, Infinity and integers of any size. `top_k: Infinity` (and
    a float field given a 400-digit integer) raised OverflowError in SamplingParams -> 500."""
    for name in NUMERIC_SAMPLING:
        content = f'{{"text": "a", "sampling_params": {{"{name}": {literal}}}}}'
        r = httpx.post(server.url("/generate"), content=content, headers={"Content-Type": "application/json"},
                       timeout=CLIENT_TIMEOUT)
        huge_top_k = name == "top_k" and literal.isdigit()   # a top_k beyond the vocabulary: disabled, fine
        assert r.status_code == (200 if huge_top_k else 400), (name, literal[:10], r.text[:200])
    bias = f'{{"text": "a", "sampling_params": {{"logit_bias": {{"5": {literal}}}}}}}'
    r = httpx.post(server.url("/generate"), content=bias, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text[:200]
