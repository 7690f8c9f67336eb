"""`OpenAI`: a DSL backend for any OpenAI-compatible server (`/v1/chat/completions`, or
`/v1/completions` with `is_chat_model=False`), through the `openai` SDK.

What works and what does not, honestly:
- Chat models see messages, not raw text, so `gen` and `select` must come right at the start of
  an assistant turn (`s += sgl.assistant(sgl.gen("x"))`); the finished messages are sent.
- `regex` / `dtype` go out as the non-standard `regex` field (radixlm, SGLang and vLLM-style
  servers honour it; OpenAI itself rejects it). `json_schema` becomes `response_format`.
- `select` cannot score choices (chat APIs do not return prompt logprobs). It generates a short
  answer and picks the choice it matches: an exact match, else the longest choice the answer starts
  with, else the choice sharing the longest prefix with it. With `constrained_select=True` the
  request also carries `regex: (choice_1|choice_2|...)`, so a server that supports it can only
  answer with a choice. The meta info says how the choice was made; there are no logprob scores.
- No prefix caching control: `cache_prefix` does nothing (the server may still cache on its own).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from ..chat_template import ChatTemplate, get_chat_template
from ..choices import ChoicesDecision, ChoicesSamplingMethod
from ..ir import SglSamplingParams
from .base import BackendError, BaseBackend, PromptState


class OpenAI(BaseBackend):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool = True, chat_template: ChatTemplate | str | None = None,
                 constrained_select: bool = False, **client_kwargs: Any) -> None:
        import openai

        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self.constrained_select = constrained_select
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or get_chat_template("default")
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self._openai = openai

    def get_model_name(self) -> str:
        return self.model_name

    # ------------------------------------------------------------ requests
    def _request_kwargs(self, params: SglSamplingParams) -> dict[str, Any]:
        params = params.resolve_dtype()
        kwargs: dict[str, Any] = {"model": self.model_name, "max_tokens": params.max_new_tokens,
                                  "stop": params.stop_list() or None}
        for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
            if getattr(params, name) is not None:
                kwargs[name] = getattr(params, name)
        extra = {k: getattr(params, k) for k in ("top_k", "min_p", "regex", "ignore_eos")
                 if getattr(params, k) not in (None, -1, 0.0, False)}
        if extra:
            kwargs["extra_body"] = extra
        if params.json_schema is not None:
            schema = params.json_schema
            schema = json.loads(schema) if isinstance(schema, str) else schema
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return kwargs

    def _chat_messages(self, s: PromptState) -> list[dict[str, Any]]:
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos:]:
            raise ValueError(
                "The OpenAI chat backend can only generate at the start of an assistant turn "
                "(s += sgl.assistant(sgl.gen(...))); raw-text prompts need a RuntimeEndpoint")
        return [{"role": m["role"], "content": m["content"]} for m in s.messages_]

    def _call(self, s: PromptState, kwargs: dict[str, Any], stream: bool) -> Any:
        try:
            if self.is_chat_model:
                return self.client.chat.completions.create(messages=self._chat_messages(s), stream=stream, **kwargs)
            return self.client.completions.create(prompt=s.text_, stream=stream, **kwargs)
        except self._openai.APIStatusError as exc:
            raise BackendError(_api_error_message(exc), exc.status_code) from exc

    def generate(self, s: PromptState, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        kwargs = self._request_kwargs(sampling_params)
        n = sampling_params.n or 1
        if n > 1:
            kwargs["n"] = n
        resp = self._call(s, kwargs, stream=False)
        texts = [(c.message.content if self.is_chat_model else c.text) or "" for c in resp.choices]
        metas = [_meta(resp.id, c.finish_reason, resp.usage) for c in resp.choices]
        return (texts, metas) if n > 1 else (texts[0], metas[0])

    def generate_stream(self, s: PromptState, sampling_params: SglSamplingParams
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
        meta: dict[str, Any] = {}
        for chunk in self._call(s, self._request_kwargs(sampling_params), stream=True):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            delta = (choice.delta.content if self.is_chat_model else choice.text) or ""
            meta = _meta(chunk.id, choice.finish_reason, getattr(chunk, "usage", None)) if choice.finish_reason \
                else {"id": chunk.id}
            yield delta, meta

    # -------------------------------------------------------------- select
    def select(self, s: PromptState, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        params = SglSamplingParams(max_new_tokens=max(16, max(len(c) for c in choices)), temperature=temperature)
        kwargs = self._request_kwargs(params)
        if self.constrained_select:
            kwargs["extra_body"] = {"regex": "(" + "|".join(re.escape(c) for c in choices) + ")"}
        resp = self._call(s, kwargs, stream=False)
        choice = resp.choices[0]
        answer = (choice.message.content if self.is_chat_model else choice.text) or ""
        index, how = match_choice(answer, choices)
        return ChoicesDecision(choices[index], {"method": "generate_and_match", "generated_text": answer,
                                                "match": how})


def match_choice(answer: str, choices: list[str]) -> tuple[int, str]:
    """(index, how): exact match, else longest choice the answer starts with, else longest common prefix."""
    stripped = answer.strip()
    for i, c in enumerate(choices):
        if stripped == c.strip():
            return i, "exact"
    starts = [i for i, c in enumerate(choices) if stripped.startswith(c.strip())]
    if starts:
        return max(starts, key=lambda i: len(choices[i])), "prefix"

    def shared(c: str) -> int:
        n = 0
        for a, b in zip(stripped.lower(), c.strip().lower(), strict=False):
            if a != b:
                break
            n += 1
        return n

    return max(range(len(choices)), key=lambda i: (shared(choices[i]), -i)), "closest"


def _meta(rid: str, finish_reason: str | None, usage: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": finish_reason} if finish_reason else None}
    if usage is not None:
        meta["prompt_tokens"] = usage.prompt_tokens
        meta["completion_tokens"] = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        meta["cached_tokens"] = getattr(details, "cached_tokens", None) if details is not None else None
    return meta


def _api_error_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(exc)
