"""SGLang-shaped results -> OpenAI response objects and SSE chunk streams.

Input items are what `TokenizerManager.generate` yields: `{"text", "output_ids", "meta_info", "index"?}`
with cumulative `text` and logprob lists. Streams are turned into deltas per choice index:

    chat:        first chunk {"delta": {"role": "assistant", "content": ""}}, then content deltas
                 (with an output parser: `reasoning_content` and `tool_calls` deltas too, see
                 runtime/parsers), then exactly one chunk with finish_reason (and matched_stop) per
                 choice; finish_reason is "tool_calls" when the choice called a tool;
    completions: text deltas (the echoed prompt first when echo), then one finish chunk per choice;
    both:        an optional usage chunk with `choices: []` (stream_options.include_usage), then
                 `data: [DONE]`. An error after the 200 went out is sent as `data: {"error": ...}`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Send

from ..parsers import ChatOutputParser, ChatStreamState
from .errors import error_body, to_api_error

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events; closes its source iterator however the stream ends (disconnects too)."""

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


# ---------------------------------------------------------------------- shared pieces
def finish_of(meta: dict[str, Any]) -> tuple[str | None, str | int | None]:
    """(OpenAI finish_reason, matched_stop) from SGLang's finish_reason dict."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    if isinstance(reason, str):
        return reason, None
    return str(reason.get("type") or "stop"), reason.get("matched")


def usage_of(items: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Prompt (and cached) tokens count once per prompt; completion tokens once per choice."""
    prompt = completion = cached = 0
    for pos, it in enumerate(items):
        meta = it.get("meta_info") or {}
        completion += int(meta.get("completion_tokens") or 0)
        if choice_index(it, pos) % n == 0:
            prompt += int(meta.get("prompt_tokens") or 0)
            cached += int(meta.get("cached_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def choice_index(item: dict[str, Any], position: int) -> int:
    """The choice index of a result: its "index" field (n > 1, batches), else its position."""
    index = item.get("index")
    return index if isinstance(index, int) else position


def _token_text(entry: Any) -> str:
    return entry[2] if len(entry) > 2 and isinstance(entry[2], str) else ""


def chat_logprobs(entries: list[Any], tops: list[Any]) -> dict[str, Any]:
    """[[logprob, id, text], ...] -> {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
    content = []
    for k, entry in enumerate(entries):
        token = _token_text(entry)
        alts = tops[k] if k < len(tops) and tops[k] else []
        content.append({"token": token, "logprob": entry[0], "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [{"token": _token_text(a), "logprob": a[0],
                                          "bytes": list(_token_text(a).encode("utf-8"))} for a in alts]})
    return {"content": content}


def completion_logprobs(entries: list[Any], tops: list[Any], offset: int) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, logprobs, top_maps, offsets = [], [], [], []
    for k, entry in enumerate(entries):
        token = _token_text(entry)
        tokens.append(token)
        logprobs.append(entry[0])
        alts = tops[k] if k < len(tops) else None
        top_maps.append({_token_text(a): a[0] for a in alts} if alts else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_maps, "text_offset": offsets}


# ---------------------------------------------------------------------- whole responses
def chat_choice(item: dict[str, Any], index: int, want_logprobs: bool,
                parser: ChatOutputParser | None = None) -> dict[str, Any]:
    meta = item.get("meta_info") or {}
    reason, matched = finish_of(meta)
    logprobs = None
    if want_logprobs:
        logprobs = chat_logprobs(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or [])
    text = item.get("text", "")
    message = parser.message(text) if parser is not None else {"role": "assistant", "content": text}
    if message.get("tool_calls") and reason == "stop":
        reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason,
            "matched_stop": matched}


def is_complete(item: dict[str, Any]) -> bool:
    """True for a choice that finished by stop or length (not aborted)."""
    reason, _ = finish_of(item.get("meta_info") or {})
    return reason in ("stop", "length")


def completion_choice(item: dict[str, Any], index: int, echo: str, want_logprobs: bool) -> dict[str, Any]:
    meta = item.get("meta_info") or {}
    reason, matched = finish_of(meta)
    logprobs = None
    if want_logprobs:
        entries = list(meta.get("output_token_logprobs") or [])
        tops = list(meta.get("output_top_logprobs") or [])
        if echo:
            entries = list(meta.get("input_token_logprobs") or []) + entries
            tops = list(meta.get("input_top_logprobs") or []) + tops
        logprobs = completion_logprobs(entries, tops, 0)
    return {"index": index, "text": echo + item.get("text", ""), "logprobs": logprobs,
            "finish_reason": reason, "matched_stop": matched}


# ---------------------------------------------------------------------- streams
@dataclass
class _Choice:
    """What has been sent so far for one choice index."""

    started: bool = False
    finished: bool = False
    text_len: int = 0
    logprob_len: int = 0
    char_offset: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    parsed: ChatStreamState | None = None   # with an output parser


def _new_logprobs(st: _Choice, meta: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or []
    new = (list(entries[st.logprob_len:]), list(tops[st.logprob_len:]))
    st.logprob_len = max(st.logprob_len, len(entries))
    return new


def _text_delta(st: _Choice, item: dict[str, Any]) -> str:
    text = item.get("text", "") or ""
    delta = text[st.text_len:]
    st.text_len = max(st.text_len, len(text))
    return delta


def _chat_deltas(st: _Choice, index: int, item: dict[str, Any], want_logprobs: bool) -> list[dict[str, Any]]:
    if st.finished:
        return []
    out: list[dict[str, Any]] = []
    if not st.started:
        st.started = True
        out.append({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None})
    st.meta = item.get("meta_info") or {}
    reason, matched = finish_of(st.meta)
    if st.parsed is not None:
        delta = st.parsed.delta(item.get("text", "") or "", final=reason is not None)
    else:
        text = _text_delta(st, item)
        delta = {"content": text} if text else {}
    logprobs = None
    if want_logprobs:
        entries, tops = _new_logprobs(st, st.meta)
        logprobs = chat_logprobs(entries, tops) if entries else None
    if reason is not None:
        st.finished = True
        if reason == "stop" and st.parsed is not None and st.parsed.called:
            reason = "tool_calls"
        out.append({"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": reason, "matched_stop": matched})
    elif delta or logprobs:
        out.append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
    return out


def _completion_deltas(st: _Choice, index: int, item: dict[str, Any], echo: str,
                       want_logprobs: bool) -> list[dict[str, Any]]:
    if st.finished:
        return []
    st.meta = item.get("meta_info") or {}
    text = _text_delta(st, item)
    entries: list[Any] = []
    tops: list[Any] = []
    if not st.started:
        st.started = True
        text = echo + text
        if echo and want_logprobs:
            entries = list(st.meta.get("input_token_logprobs") or [])
            tops = list(st.meta.get("input_top_logprobs") or [])
    logprobs = None
    if want_logprobs:
        new_entries, new_tops = _new_logprobs(st, st.meta)
        entries, tops = entries + new_entries, tops + new_tops
        if entries:
            logprobs = completion_logprobs(entries, tops, st.char_offset)
            st.char_offset += sum(len(_token_text(e)) for e in entries)
    reason, matched = finish_of(st.meta)
    if reason is not None:
        st.finished = True
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                 "matched_stop": matched}]
    if text or logprobs:
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}]
    return []


async def chat_stream(stream: AsyncIterator[Any], meta: Any, want_logprobs: bool, include_usage: bool,
                      parser: ChatOutputParser | None = None,
                      on_finished: Callable[[dict[str, Any]], None] | None = None) -> AsyncIterator[bytes]:
    """on_finished(item) is called once per choice that completes (stop or length)."""

    def deltas(st: _Choice, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        if parser is not None and st.parsed is None:
            st.parsed = ChatStreamState(parser)
        out = _chat_deltas(st, index, item, want_logprobs)
        if st.finished and out and on_finished is not None and is_complete(item):
            on_finished(item)
        return out

    async for chunk in _stream(stream, meta, "chat.completion.chunk", deltas, include_usage, chat=True):
        yield chunk


async def completion_stream(stream: AsyncIterator[Any], meta: Any, echo: list[str], want_logprobs: bool,
                            include_usage: bool) -> AsyncIterator[bytes]:
    def deltas(st: _Choice, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        return _completion_deltas(st, index, item, echo[index // meta.n], want_logprobs)

    async for chunk in _stream(stream, meta, "text_completion", deltas, include_usage, chat=False):
        yield chunk


async def _stream(stream: AsyncIterator[Any], meta: Any, kind: str, deltas: Any, include_usage: bool,
                  chat: bool) -> AsyncIterator[bytes]:
    states: dict[int, _Choice] = {}

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body = {"id": meta.id, "object": kind, "created": meta.created, "model": meta.model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    try:
        async for out in stream:
            for pos, item in enumerate(out if isinstance(out, list) else [out]):
                index = choice_index(item, pos)
                for choice in deltas(states.setdefault(index, _Choice()), index, item):
                    yield chunk([choice])
        for index, st in sorted(states.items()):
            if not st.finished:   # the source ended early: still close every choice exactly once
                end = {"delta": {}} if chat else {"text": ""}
                yield chunk([{"index": index, **end, "logprobs": None, "finish_reason": "abort"}])
        if include_usage:
            items = [{"index": i, "meta_info": st.meta} for i, st in sorted(states.items())]
            yield chunk([], usage_of(items, meta.n))
    except Exception as e:   # the 200 is already out: report in-band, as OpenAI does
        err = to_api_error(e)
        yield sse(error_body(err.status, err.message, err.param, err.code))
    yield DONE
