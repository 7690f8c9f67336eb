"""A table of bad requests against the real server (started with --api-key): every one gets a 4xx
with the OpenAI error body and a message that names the problem; none gets a 5xx; afterwards the
server is healthy and no KV slot or req row leaked. The API key never appears in the log.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server_fixtures import ServerProcess, server_fixture, wait_kv_free

API_KEY = "sk-test-7f3a9c"
MAX_BYTES = 65536
SERVER_FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "256", "--max-total-tokens", "8192",
                "--max-request-bytes", str(MAX_BYTES))

G, CHAT, CMPL = "/generate", "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hello"}]


def gen(**sp: object) -> dict:
    return {"text": "hello", "sampling_params": sp}


def chat(**fields: object) -> dict:
    return {"model": "m", "messages": USER, "max_tokens": 4, **fields}


def cmpl(**fields: object) -> dict:
    return {"model": "m", "prompt": "hello", "max_tokens": 4, **fields}


# (id, method, path, body: dict | bytes | None, headers, status, message regex)
CASES = [
    # ---- malformed or mistyped bodies
    ("malformed-json", "POST", G, b'{"text": "a", ', None, 400, "Malformed JSON"),
    ("json-array-body", "POST", G, b"[1, 2]", None, 400, "JSON object"),
    ("empty-body", "POST", G, b"", None, 400, "missing"),
    ("text-not-string", "POST", G, {"text": 5}, None, 400, "text"),
    ("ids-not-ints", "POST", G, {"input_ids": ["a", "b"]}, None, 400, "input_ids"),
    ("stream-not-bool", "POST", G, {"text": "a", "stream": "yes"}, None, 400, "stream"),
    ("sampling-params-not-object", "POST", G, {"text": "a", "sampling_params": 3}, None, 400, "sampling_params"),
    ("unsupported-image", "POST", G, {"text": "a", "image_data": "x.png"}, None, 400, "'image_data' is not supported"),
    ("unsupported-hidden", "POST", G, {"text": "a", "return_hidden_states": True}, None, 400, "return_hidden_states"),
    ("beam-search", "POST", G, gen(beam_width=4), None, 400, "beam_width"),
    ("invalid-stop-regex", "POST", G, gen(stop_regex="(a"), None, 400, "stop_regex"),
    ("unknown-sampling-param", "POST", G, gen(temprature=0.5), None, 400, "temprature"),
    ("unsupported-lora", "POST", G, {"text": "a", "lora_path": "x"}, None, 400, "lora_path"),
    ("text-and-ids", "POST", G, {"text": "a", "input_ids": [1]}, None, 400, "Exactly one"),
    ("no-input", "POST", G, {"sampling_params": {}}, None, 400, "Exactly one"),
    ("empty-text", "POST", G, {"text": ""}, None, 400, "empty"),
    ("empty-ids", "POST", G, {"input_ids": []}, None, 400, "empty"),
    ("empty-batch", "POST", G, {"text": []}, None, 400, "empty"),
    ("token-out-of-vocab", "POST", G, {"input_ids": [5, 10**9]}, None, 400, "token id"),
    ("rid-list-for-single", "POST", G, {"text": "a", "rid": ["x", "y"]}, None, 400, "rid"),
    ("params-list-length", "POST", G, {"text": ["a", "b"], "sampling_params": [{}]}, None, 400, "sampling_params"),
    ("duplicate-rids", "POST", G, {"text": ["a", "b"], "rid": ["same", "same"]}, None, 400, "Duplicate"),
    # ---- sampling values
    ("negative-temperature", "POST", G, gen(temperature=-1), None, 400, "temperature"),
    ("nan-temperature", "POST", G, b'{"text": "a", "sampling_params": {"temperature": NaN}}', None, 400,
     "temperature"),
    ("string-temperature", "POST", G, gen(temperature="hot"), None, 400, "temperature"),
    ("top-p-zero", "POST", G, gen(top_p=0), None, 400, "top_p"),
    ("top-p-above-one", "POST", G, gen(top_p=1.5), None, 400, "top_p"),
    ("top-k-negative", "POST", G, gen(top_k=-5), None, 400, "top_k"),
    ("min-p-above-one", "POST", G, gen(min_p=2), None, 400, "min_p"),
    ("repetition-penalty-zero", "POST", G, gen(repetition_penalty=0), None, 400, "repetition_penalty"),
    ("frequency-penalty-big", "POST", G, gen(frequency_penalty=5), None, 400, "frequency_penalty"),
    ("max-new-tokens-negative", "POST", G, gen(max_new_tokens=-1), None, 400, "max_new_tokens"),
    ("max-new-tokens-over-context", "POST", G, gen(max_new_tokens=100000), None, 400, "context"),
    ("min-over-max-new-tokens", "POST", G, gen(max_new_tokens=2, min_new_tokens=5), None, 400, "min_new_tokens"),
    ("prompt-over-context", "POST", G, {"input_ids": [7] * 300}, None, 400, "context"),
    ("n-zero", "POST", G, gen(n=0), None, 400, r"\bn\b"),
    ("huge-logit-bias-id", "POST", G, gen(logit_bias={"99999999": 1.0}), None, 400, "logit_bias"),
    ("logit-bias-bad-key", "POST", G, gen(logit_bias={"abc": 1.0}), None, 400, "logit_bias"),
    ("stop-wrong-type", "POST", G, gen(stop=5), None, 400, "stop"),
    ("negative-stop-token", "POST", G, gen(stop_token_ids=[-3]), None, 400, "stop_token_ids"),
    ("invalid-regex", "POST", G, gen(regex="(", max_new_tokens=4), None, 400, "[Rr]egex"),
    ("invalid-json-schema", "POST", G, gen(json_schema="{not json", max_new_tokens=4), None, 400, "[Ss]chema"),
    ("two-constraints", "POST", G, gen(regex="a", json_schema="{}"), None, 400, "Only one"),
    ("bad-logprob-start", "POST", G, {"text": "a", "logprob_start_len": -5}, None, 400, "logprob_start_len"),
    ("bad-top-logprobs-num", "POST", G, {"text": "a", "top_logprobs_num": -1}, None, 400, "top_logprobs_num"),
    # ---- OpenAI chat
    ("chat-malformed-json", "POST", CHAT, b'{"messages": [', None, 400, "Malformed JSON"),
    ("chat-no-messages", "POST", CHAT, {"model": "m"}, None, 400, "messages"),
    ("chat-empty-messages", "POST", CHAT, chat(messages=[]), None, 400, "messages"),
    ("chat-unknown-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), None, 400, "role"),
    ("chat-content-int", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, 400, "content"),
    ("chat-image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), None, 400, "text parts"),
    ("chat-n-zero", "POST", CHAT, chat(n=0), None, 400, r"\bn\b"),
    ("chat-n-huge", "POST", CHAT, chat(n=100000), None, 400, r"\bn\b"),
    ("chat-negative-temperature", "POST", CHAT, chat(temperature=-0.5), None, 400, "temperature"),
    ("chat-top-p-zero", "POST", CHAT, chat(top_p=0), None, 400, "top_p"),
    ("chat-max-tokens-over-context", "POST", CHAT, chat(max_tokens=100000), None, 400, "context"),
    ("chat-prompt-over-context", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 400}]),
     None, 400, "context"),
    ("chat-huge-logit-bias-id", "POST", CHAT, chat(logit_bias={"123456789": 5}), None, 400, "logit_bias"),
    ("chat-invalid-regex", "POST", CHAT, chat(regex="[a-"), None, 400, "[Rr]egex"),
    ("chat-invalid-regex-stream", "POST", CHAT, chat(regex="[a-", stream=True), None, 400, "[Rr]egex"),
    ("chat-top-logprobs-too-many", "POST", CHAT, chat(logprobs=True, top_logprobs=50), None, 400, "top_logprobs"),
    ("chat-top-logprobs-no-logprobs", "POST", CHAT, chat(top_logprobs=2), None, 400, "logprobs"),
    ("chat-schema-missing", "POST", CHAT, chat(response_format={"type": "json_schema"}), None, 400, "schema"),
    ("chat-format-unknown", "POST", CHAT, chat(response_format={"type": "xml"}), None, 400, "response_format"),
    ("chat-tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), None, 400,
     "tools"),
    # ---- OpenAI completions
    ("cmpl-no-prompt", "POST", CMPL, {"model": "m"}, None, 400, "prompt"),
    ("cmpl-empty-prompt-list", "POST", CMPL, cmpl(prompt=[]), None, 400, "prompt"),
    ("cmpl-mixed-prompt", "POST", CMPL, cmpl(prompt=["a", 5]), None, 400, "prompt"),
    ("cmpl-logprobs-too-many", "POST", CMPL, cmpl(logprobs=100), None, 400, "logprobs"),
    ("cmpl-suffix", "POST", CMPL, cmpl(suffix="end"), None, 400, "suffix"),
    ("cmpl-best-of", "POST", CMPL, cmpl(best_of=3), None, 400, "best_of"),
    ("cmpl-negative-max-tokens", "POST", CMPL, cmpl(max_tokens=-1), None, 400, "max_tokens"),
    # ---- other routes
    ("abort-no-rid", "POST", "/abort_request", {}, None, 400, "rid"),
    ("abort-rid-int", "POST", "/abort_request", {"rid": 5}, None, 400, "rid"),
    ("unknown-model", "GET", "/v1/models/gpt-17", None, None, 404, "does not exist"),
    ("unknown-route", "GET", "/no/such/route", None, None, 404, "Not Found"),
    ("wrong-method", "GET", G, None, None, 405, "Method Not Allowed"),
    ("body-too-large", "POST", G, {"text": "x" * (MAX_BYTES + 10)}, None, 413, "max-request-bytes"),
    # ---- authentication
    ("wrong-api-key", "POST", G, gen(), {"Authorization": "Bearer wrong"}, 401, "API key"),
    ("missing-api-key", "GET", "/get_model_info", None, {"Authorization": ""}, 401, "API key"),
    ("basic-auth", "GET", "/v1/models", None, {"Authorization": f"Basic {API_KEY}"}, 401, "API key"),
    ("key-without-scheme", "GET", "/get_server_info", None, {"Authorization": API_KEY}, 401, "API key"),
]


server = server_fixture(*SERVER_FLAGS, api_key=API_KEY)


def send(server: ServerProcess, method: str, path: str, body: dict | bytes | None,
         headers: dict | None) -> httpx.Response:
    merged = {**server.headers, "x-stainless-lang": "python", **(headers or {})}
    merged = {k: v for k, v in merged.items() if v}
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    if content is not None:
        merged.setdefault("Content-Type", "application/json")
    return httpx.request(method, server.url(path), content=content, headers=merged, timeout=60)


def test_table_has_enough_cases() -> None:
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server: ServerProcess, case: tuple) -> None:
    _, method, path, body, headers, status, pattern = case
    r = send(server, method, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert re.search(pattern, err["message"]), err["message"]


def test_open_routes_need_no_key(server: ServerProcess) -> None:
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/metrics")).status_code == 200
    assert httpx.get(server.url("/health_generate")).status_code == 401
    ok = send(server, "POST", G, gen(max_new_tokens=2), None)
    assert ok.status_code == 200, ok.text


def test_server_healthy_no_leak_after_bad_inputs(server: ServerProcess) -> None:
    for case in CASES:     # once more, back to back, then check the server's state
        assert send(server, *case[1:5]).status_code < 500
    assert httpx.get(server.url("/health_generate"), headers=server.headers, timeout=60).status_code == 200
    wait_kv_free(server)
    assert API_KEY not in server.log()
