"""SGLang wire compatibility of /generate and hostile grammars, against the real server (tiny llama).

- every field of SGLang's GenerateReqInput and SamplingParams is accepted when unset;
- stop_regex (plain and streamed), EBNF, structural tags, json.dumps-style JSON, `\\d`, anchors;
- issue 18: pathological regexes get a 400 from a killed compile worker within the deadline while a
  JSON-schema request answers normally, and the scheduler's memory does not grow.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time

import httpx
import jsonschema
import pytest

from tests.server_fixtures import ServerProcess, child_pids, start_server, wait_kv_free

FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "512", "--max-total-tokens", "8192",
         "--grammar-compile-timeout", "3")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}


@pytest.fixture(scope="module")
def server(llama_path: str):
    srv = start_server(llama_path, *FLAGS)
    yield srv
    srv.stop()


def gen(server: ServerProcess, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(server.url("/generate"), json=body, timeout=timeout)


def params(**kw: object) -> dict:
    return {"max_new_tokens": 24, "temperature": 0, **kw}


# ------------------------------------------------------------------ accepted fields
SGLANG_UNSET_FIELDS = {
    "session_id": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "use_audio_in_video": False, "video_config": None, "watermark": None,
    "token_ids_logprob": None, "return_sampling_mask": None, "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_output_top_logprobs": False, "log_metrics": True,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_params": None, "lora_path": None, "lora_id": None,
    "custom_logit_processor": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None, "routing_key": None, "conversation_id": None, "background": False,
    "require_reasoning": False, "max_thinking_tokens": None, "extra_key": None, "no_logs": False,
    "custom_labels": None, "return_bytes": False, "return_entropy": False, "return_prompt_token_ids": False,
    "external_trace_header": None, "received_time": None, "cache_salt": None, "kv_hints": None,
    "stream_output": False,   # not an SGLang field either: ignored
}
SGLANG_SAMPLING_UNSET = {"stop_regex": [], "stream_interval": None, "custom_params": None, "beam_width": None,
                         "structural_tag": None, "ebnf": None, "regex": None, "json_schema": None,
                         "stop_token_ids": [119690], "logit_bias": None, "sampling_seed": None, "watermark": None}


def test_every_sglang_field_accepted_when_unset(server: ServerProcess) -> None:
    body = {"text": "hello", "sampling_params": params(max_new_tokens=4, **SGLANG_SAMPLING_UNSET),
            **SGLANG_UNSET_FIELDS}
    r = gen(server, body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize(("field", "value"), [("image_data", "a.png"), ("lora_path", "x"),
                                               ("return_routed_experts", True), ("bootstrap_host", "h")])
def test_sglang_field_set_to_unsupported_value_is_400(server: ServerProcess, field: str, value: object) -> None:
    r = gen(server, {"text": "hi", field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------ stop_regex
def test_stop_regex_plain_and_streamed(server: ServerProcess) -> None:
    sp = params(regex=r"hello world [0-9]{3}", stop_regex=[r"wor\w+"])
    r = gen(server, {"text": "say", "sampling_params": sp})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == "hello "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"wor\w+"}
    with httpx.stream("POST", server.url("/generate"), json={"text": "say", "sampling_params": sp, "stream": True},
                      timeout=120) as resp:
        events = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert all("wor" not in e["text"] for e in events)
    assert events[-1]["text"] == "hello " and events[-1]["meta_info"]["finish_reason"]["matched"] == r"wor\w+"


# ------------------------------------------------------------------ grammars
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_ebnf_yes_no_and_arithmetic(server: ServerProcess, temperature: float) -> None:
    for seed in range(3):
        sp = params(ebnf='root ::= "yes" | "no"', temperature=temperature, sampling_seed=seed)
        r = gen(server, {"text": "Answer:", "sampling_params": sp})
        assert r.status_code == 200, r.text
        assert r.json()["text"] in ("yes", "no")
    arith = ('root ::= expr\nexpr ::= term (("+" | "-") term)?\nterm ::= num | "(" num "*" num ")"\n'
             'num ::= [1-9] [0-9]?')
    arith_re = r"(N|\(N\*N\))([+-](N|\(N\*N\)))?".replace("N", "[1-9][0-9]?")
    for seed in range(3):
        r = gen(server, {"text": "1+1=", "sampling_params": params(ebnf=arith, temperature=temperature,
                                                                    sampling_seed=seed, max_new_tokens=40)})
        assert r.status_code == 200, r.text
        assert re.fullmatch(arith_re, r.json()["text"]), r.json()["text"]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_structural_tag(server: ServerProcess, temperature: float) -> None:
    fn_schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    forced = {"type": "structural_tag", "format": {"type": "tag", "begin": "<function=f>", "end": "</function>",
                                                   "content": {"type": "json_schema", "json_schema": fn_schema}}}
    r = gen(server, {"text": "Call f:", "sampling_params": params(structural_tag=json.dumps(forced),
                                                                   temperature=temperature, max_new_tokens=48)})
    assert r.status_code == 200, r.text
    m = re.fullmatch(r"<function=f>(.*)</function>", r.json()["text"], re.S)
    assert m, r.json()["text"]
    jsonschema.validate(json.loads(m.group(1)), fn_schema)
    legacy = {"type": "structural_tag", "triggers": ["<function="],
              "structures": [{"begin": "<function=f>", "schema": fn_schema, "end": "</function>"}]}
    r = gen(server, {"text": "Call f:", "sampling_params": params(structural_tag=legacy, temperature=temperature)})
    assert r.status_code == 200, r.text
    for call in re.findall(r"<function=f>(.*?)</function>", r.json()["text"], re.S):
        jsonschema.validate(json.loads(call), fn_schema)


def test_json_reads_like_json_dumps_and_digits_are_ascii(server: ServerProcess) -> None:
    r = gen(server, {"text": "Person:", "sampling_params": params(json_schema=json.dumps(SCHEMA), max_new_tokens=48)})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    assert text == json.dumps(json.loads(text)), text      # ", " and ": " separators, nothing else
    for regex in (r"^\d{6}$", r"\d{6}"):
        r = gen(server, {"text": "Number:", "sampling_params": params(regex=regex, temperature=1.0, sampling_seed=3)})
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"[0-9]{6}", r.json()["text"]), r.json()["text"]


# ------------------------------------------------------------------ hostile grammars (issue 18)
def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_hostile_regexes_get_400_while_json_answers(server: ServerProcess) -> None:
    children = child_pids(server.proc.pid)
    before = {pid: _rss_mb(pid) for pid in children}
    hostile = [{"text": "x", "sampling_params": params(regex=r"(.*a.{20}b)")},
               {"text": "x", "sampling_params": params(regex=r"(.*a.{21}b)")},
               {"text": "x", "sampling_params": params(regex="a" * (1 << 20))}]
    good = {"text": "Person:", "sampling_params": params(json_schema=json.dumps({**SCHEMA, "title": "fresh"}))}
    started = time.monotonic()
    with cf.ThreadPoolExecutor(4) as pool:
        bad_futures = [pool.submit(gen, server, body) for body in hostile]
        time.sleep(0.2)
        good_response = pool.submit(gen, server, good).result()
        bad_responses = [f.result() for f in bad_futures]
    assert good_response.status_code == 200, good_response.text
    jsonschema.validate(json.loads(good_response.json()["text"]), SCHEMA)
    for r in bad_responses:
        assert r.status_code == 400, r.text
    assert "timed out after 3 s" in bad_responses[0].json()["error"]["message"]
    assert "--max-constraint-bytes" in bad_responses[2].json()["error"]["message"]
    assert time.monotonic() - started < 60
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    for pid in children:
        assert _rss_mb(pid) - before[pid] < 200, (pid, before[pid], _rss_mb(pid))
    wait_kv_free(server)


def test_dsl_gen_stop_regex(server: ServerProcess) -> None:
    import radixlm as rl

    @rl.function
    def prog(s):
        s += "Code: " + rl.gen("code", max_tokens=24, regex=r"[a-z]{3} [0-9]{4} [a-z]+", stop_regex=r"[0-9]{4}",
                               temperature=0)

    state = prog.run(backend=rl.RuntimeEndpoint(server.base_url))
    assert re.fullmatch(r"[a-z]{3} ", state["code"]), state["code"]
    assert state.get_meta_info("code")["finish_reason"]["matched"] == r"[0-9]{4}"
