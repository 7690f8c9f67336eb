"""Unit tests for the hostile-input guards (issue 18): the rid registry's lifecycle, the cheap field
validation, the tokenization helpers and the per-request output budget. No processes, no server."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from radixlm.runtime.managers.io_struct import GenerateReqInput
from radixlm.runtime.managers.req_state import ReqState, RidRegistry, charge_output, over_budget
from radixlm.runtime.managers.request_builder import PREFIX_MARGIN_TOKENS, check_prefix_fits, encode_texts
from radixlm.runtime.managers.request_validation import (
    MAX_RID_CHARS,
    check_logprob_start,
    input_size,
    validate_generate_fields,
)


def _state(rid: str, stream: bool = False, logprob: bool = False) -> ReqState:
    return ReqState(rid, 0, asyncio.Queue(), logprob, False, 3, stream=stream)


# ---------------------------------------------------------------- rid registry
def test_rid_is_taken_until_the_aborted_request_drains() -> None:
    async def run() -> None:
        reg = RidRegistry(wait_s=0.2)
        old = _state("R0")
        await reg.reserve([old])
        reg.release(old, draining=True)               # aborted mid-flight: abort sent, no final output yet
        assert reg.in_use("R0") and reg.on_output("R0", finished=False) is None
        with pytest.raises(ValueError, match="still being aborted"):
            await reg.reserve([_state("R0")])
        new = _state("R0")
        waiter = asyncio.ensure_future(reg.reserve([new]))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        assert reg.on_output("R0", finished=True) is None    # the abort's final output: not routed to `new`
        await waiter
        assert reg.active["R0"] is new and not reg.draining
        assert reg.on_output("R0", finished=False) is new

    asyncio.run(run())


def test_active_rid_waits_then_400_and_finished_rid_frees_at_once() -> None:
    async def run() -> None:
        reg = RidRegistry(wait_s=0.1)
        first = _state("A")
        await reg.reserve([first])
        with pytest.raises(ValueError, match="in flight"):
            await reg.reserve([_state("A")])
        second = _state("A")
        waiter = asyncio.ensure_future(reg.reserve([second, _state("B")]))
        await asyncio.sleep(0)
        reg.release(first, draining=False)            # finished normally: free at once
        await waiter
        assert reg.active["A"] is second and "B" in reg.active

    asyncio.run(run())


def test_failed_reservation_reserves_nothing_and_clear_frees_draining() -> None:
    async def run() -> None:
        reg = RidRegistry(wait_s=0.05)
        st = _state("X")
        await reg.reserve([st])
        reg.release(st, draining=True)
        with pytest.raises(ValueError):
            await reg.reserve([_state("Y"), _state("X")])
        assert "Y" not in reg.active
        reg.clear_draining()
        await reg.reserve([_state("X")])

    asyncio.run(run())


def test_draining_rid_expires() -> None:
    async def run() -> None:
        reg = RidRegistry(wait_s=0.05, expire_s=0.0)
        st = _state("E")
        await reg.reserve([st])
        reg.release(st, draining=True)
        await asyncio.sleep(0.01)
        await reg.reserve([_state("E")])

    asyncio.run(run())


# ---------------------------------------------------------------- field validation
@pytest.mark.parametrize("fields,needle", [
    ({"rid": "\ud800"}, "rid"),
    ({"rid": "x" * (MAX_RID_CHARS + 1)}, "rid"),
    ({"rid": ""}, "rid"),
    ({"rid": 5}, "rid"),
    ({"rid": "tab\there"}, "rid"),
    ({"text": ["a", "b"], "rid": ["ok", None]}, "rid"),
    ({"top_logprobs_num": 21}, "top_logprobs_num"),
    ({"top_logprobs_num": 2.0}, "top_logprobs_num"),
    ({"top_logprobs_num": True}, "top_logprobs_num"),
    ({"logprob_start_len": 1.5}, "logprob_start_len"),
    ({"logprob_start_len": -2}, "logprob_start_len"),
    ({"sampling_params": {"max_new_tokens": 1e3}}, "max_new_tokens"),
    ({"sampling_params": {"min_new_tokens": 1.0}}, "min_new_tokens"),
    ({"sampling_params": {"top_k": 5.0}}, "top_k"),
    ({"sampling_params": {"\udc00": 1}}, "lone surrogate"),
    ({"sampling_params": {"json_schema": {"properties": {"a": {"pattern": "\ud834"}}}}}, "lone surrogate"),
    ({"text": "caf\udce9"}, "lone surrogate"),
    ({"text": ["fine", "bad\ud800"]}, "item 1"),
])
def test_bad_fields_are_rejected(fields: dict, needle: str) -> None:
    obj = GenerateReqInput(**{"text": "hello", **fields})
    with pytest.raises(ValueError, match=needle):
        validate_generate_fields(obj, max_top_logprobs=20)


def test_good_fields_pass() -> None:
    obj = GenerateReqInput(text=["héllo 日本", "x"], rid=["r-1", "r_2:ü"], top_logprobs_num=[20, 0],
                           logprob_start_len=[-1, 0],
                           sampling_params={"max_new_tokens": 8, "top_k": -1, "temperature": 0.5,
                                            "sampling_seed": 3, "stop": ["\n"]})
    validate_generate_fields(obj, max_top_logprobs=20)


def test_logprob_start_must_be_inside_the_prompt() -> None:
    check_logprob_start(0, 1)
    check_logprob_start(4, 5)
    with pytest.raises(ValueError, match="less than the prompt length"):
        check_logprob_start(5, 5)


def test_input_size_counts_characters_and_ids() -> None:
    assert input_size(GenerateReqInput(text="abcd")) == 4
    assert input_size(GenerateReqInput(text=["ab", "c"])) == 5
    assert input_size(GenerateReqInput(input_ids=[1, 2, 3])) == 3
    assert input_size(GenerateReqInput(input_ids=[[1, 2], [3]])) == 5


# ---------------------------------------------------------------- tokenization helpers
TEXTS = ["hello world", "<|im_start|>user\nhi<|im_end|>", "  spaces \n\n\ttabs", "ünïcödé 日本語 🎉", "", "a" * 500]


def test_encode_texts_matches_the_tokenizer(tiny_model_path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert encode_texts(tok, TEXTS) == tok(TEXTS)["input_ids"]


def test_prefix_check_refuses_only_texts_whose_head_overflows(llama_path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_path)
    long_text = "quick brown fox " * 5000
    head_tokens = len(encode_texts(tok, [long_text[:4000]])[0])
    check_prefix_fits(tok, [long_text], head_tokens - PREFIX_MARGIN_TOKENS, 4000)   # at the margin: fine
    check_prefix_fits(tok, ["short"], 1, 4000)                                       # shorter than the head
    with pytest.raises(ValueError, match="context length"):
        check_prefix_fits(tok, ["ok", long_text], head_tokens - PREFIX_MARGIN_TOKENS - 1, 4000)


# ---------------------------------------------------------------- output budget
def _tok(new_ids: int, top: int) -> SimpleNamespace:
    return SimpleNamespace(new_token_ids=[1] * new_ids, output_token_logprobs=[(0.0, 1)] * new_ids,
                           output_top_logprobs=[[(0.0, 1)] * top] * new_ids,
                           input_token_logprobs=[(0.0, 1)] * 1000, input_top_logprobs=None)


def test_unsent_budget_applies_to_streams_and_skips_input_logprobs() -> None:
    st = _state("s", stream=True, logprob=True)
    charge_output(st, _tok(1, 20), "x")
    assert st.out_bytes > st.unsent_bytes > 0          # input logprobs count toward the response only
    assert over_budget(st, 10**9, 10**9) is None
    for _ in range(200):
        charge_output(st, _tok(1, 20), "x")
    assert "did not read the stream" in over_budget(st, 10**9, 64 * 1024)
    st.unsent_bytes = 0                                # the consumer took a chunk
    assert over_budget(st, 10**9, 64 * 1024) is None
    assert "--max-response-bytes" in over_budget(st, 1000, 10**9)
    plain = _state("p", stream=False, logprob=True)
    for _ in range(200):
        charge_output(plain, _tok(1, 20), "x")
    assert over_budget(plain, 10**9, 1) is None        # not a stream: only the response cap applies


def test_memory_trimmer_runs_once_idle_after_large_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixlm.runtime.managers.req_state as req_state

    monkeypatch.setattr(req_state, "TRIM_DELAY_S", 0.0)
    calls: list[int] = []

    async def run() -> None:
        idle = {"now": False}
        trimmer = req_state.MemoryTrimmer(lambda: idle["now"])
        trimmer._malloc_trim = calls.append
        trimmer.note_released(req_state.TRIM_AFTER_BYTES)      # busy: nothing scheduled
        await asyncio.sleep(0.01)
        assert calls == []
        idle["now"] = True
        trimmer.note_released(1)
        await asyncio.sleep(0.01)
        assert calls == [0] and trimmer.released == 0
        trimmer.note_released(1)                               # below the threshold again
        await asyncio.sleep(0.01)
        assert calls == [0]

    asyncio.run(run())
