"""Unit tests for the front door (issue 29): the RequestBuilder validates a request once (large inputs
too), splits a batch into single-prompt GenerateReqInputs, the OpenAI routes cap top_logprobs with
--max-top-logprobs, and the one first-item helper maps failures to statuses. No processes, no model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

import radixlm.runtime.managers.request_builder as request_builder
from radixlm.runtime.entrypoints.errors import APIError, only_item, start_stream
from radixlm.runtime.entrypoints.openai_api import OpenAIServing
from radixlm.runtime.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixlm.runtime.managers.io_struct import GenerateReqInput
from radixlm.runtime.managers.request_builder import LARGE_INPUT, RequestBuilder
from radixlm.runtime.server_args import ServerArgs

VOCAB = 1000


def _builder(**args: Any) -> RequestBuilder:
    return RequestBuilder(ServerArgs(**args), tokenizer=None, vocab_size=VOCAB, context_len=LARGE_INPUT * 4,
                          max_total_tokens=None)


@pytest.mark.parametrize("num_ids", [8, LARGE_INPUT + 1])
def test_fields_are_validated_once(monkeypatch: pytest.MonkeyPatch, num_ids: int) -> None:
    calls: list[Any] = []
    real = request_builder.validate_generate_fields
    monkeypatch.setattr(request_builder, "validate_generate_fields", lambda obj, top: calls.append(obj) or real(obj, top))
    builder = _builder()
    obj = GenerateReqInput(input_ids=[1] * num_ids, sampling_params={"max_new_tokens": 2}, rid="r")
    try:
        reqs, is_single, _ = asyncio.run(builder.build(obj))
    finally:
        builder.close()
    assert calls == [obj] and is_single and [r.rid for r in reqs] == ["r"] and len(reqs[0].input_ids) == num_ids


def test_batch_items_are_single_prompt_requests() -> None:
    obj = GenerateReqInput(input_ids=[[1, 2], [3]], rid=["a", "b"], top_logprobs_num=[1, 2], return_logprob=True,
                           sampling_params={"max_new_tokens": 1, "n": 2}, stream=True, priority=3)
    items, is_single = request_builder._split_items(obj)
    assert not is_single and [it.input_ids for it in items] == [[1, 2], [3]]
    assert [(it.rid, it.top_logprobs_num, it.return_logprob, it.stream, it.priority) for it in items] == [
        ("a", 1, True, True, 3), ("b", 2, True, True, 3)]
    reqs, is_single, _ = asyncio.run(_builder().build(obj))
    assert [(r.rid, r.group_rid, r.top_logprobs_num) for r in reqs] == [
        ("a-0", "a", 1), ("a-1", "a", 1), ("b-0", "b", 2), ("b-1", "b", 2)]


def test_top_logprobs_over_the_vocabulary_is_refused() -> None:
    obj = GenerateReqInput(input_ids=[1], top_logprobs_num=VOCAB + 1)
    with pytest.raises(ValueError, match=rf"top_logprobs_num must be in \[0, {VOCAB}\]"):
        asyncio.run(_builder(max_top_logprobs=VOCAB + 5).build(obj))


def _serving(max_top_logprobs: int) -> OpenAIServing:
    tm = SimpleNamespace(tokenizer=None, vocab_size=VOCAB, context_len=64, scheduler_info={})
    return OpenAIServing(tm, "m", "m", chat_template=None, max_top_logprobs=max_top_logprobs)


def test_openai_top_logprobs_cap_is_the_flag() -> None:
    serving = _serving(5)
    with pytest.raises(APIError, match=r"logprobs must be in \[0, 5\]") as err:
        asyncio.run(serving.completions(CompletionRequest(prompt=[1, 2], logprobs=6), None))
    assert err.value.status == 400
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=6)
    with pytest.raises(APIError, match=r"top_logprobs must be in \[0, 5\]") as err:
        asyncio.run(serving.chat_completions(chat, None))
    assert err.value.status == 400


class _Stream:
    """An async generator stand-in that records aclose()."""

    def __init__(self, items: list[Any], error: BaseException | None = None):
        self.items, self.error, self.closed = list(items), error, False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if self.error is not None:
            raise self.error
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def test_first_item_helpers() -> None:
    async def run() -> None:
        one = _Stream([{"text": "a"}, {"text": "b"}])
        assert await only_item(one) == {"text": "a"} and one.closed
        rest = _Stream([{"text": "a"}, {"text": "b"}])
        stream = await start_stream(rest)
        assert [x["text"] async for x in stream] == ["a", "b"] and rest.closed
        rejected = {"meta_info": {"finish_reason": {"type": "abort", "status_code": 422}}}
        for make, status in [(lambda: _Stream([], ValueError("bad")), 400),
                             (lambda: _Stream([], RuntimeError("dead")), 503),
                             (lambda: _Stream([]), 500), (lambda: _Stream([rejected]), 422)]:
            for helper in (only_item, start_stream):
                source = make()
                with pytest.raises(APIError) as err:
                    await helper(source)
                assert err.value.status == status and (source.closed or status == 500)

    asyncio.run(run())


def test_http_body_and_request_model_have_the_same_fields() -> None:
    """/generate parses its JSON into GenerateRequest and builds GenerateReqInput(**body.model_dump())."""
    import dataclasses

    from radixlm.runtime.entrypoints.openai_protocol import GenerateRequest

    assert set(GenerateRequest.model_fields) == {f.name for f in dataclasses.fields(GenerateReqInput)}
