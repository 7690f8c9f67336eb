"""The OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each request becomes one `GenerateReqInput` for the TokenizerManager; the SGLang-shaped results
are reshaped into OpenAI objects by openai_format.py. There is one model: any
`model` name in a request is accepted and served by it, and responses name the served model.

Chat prompts are rendered and tokenized here (chat_template.py), so special-token text typed in a
message stays plain text; the ids go to the TokenizerManager as `input_ids`, which makes
`usage.prompt_tokens` the exact count the model saw. History the model generated is encoded with the
ids it was generated as (chat_history.py), so agent loops keep their cache hits. Tools, tool_choice
and reasoning: openai_tools.py; output parsing: runtime/parsers/.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request
from starlette.responses import Response

from ..managers.io_struct import GenerateReqInput
from ..parsers import get_reasoning_parser, get_tool_call_parser
from .chat_history import GeneratedHistory
from .chat_template import (
    ChatRequestInput,
    JinjaChatTemplate,
    encode_chat_prompt,
    normalize_messages,
)
from .errors import APIError, json_response, only_item, start_stream
from .openai_format import (
    SSEResponse,
    chat_choice,
    chat_stream,
    choice_index,
    completion_choice,
    completion_stream,
    is_complete,
    usage_of,
)
from .openai_protocol import ChatCompletionRequest, CompletionRequest
from .openai_tools import (
    constrain_after_reasoning,
    output_parser,
    setup_tools,
)

JSON_OBJECT_SCHEMA = '{"type": "object"}'   # response_format json_object: any JSON object


class OpenAIServing:
    """Turns OpenAI requests into TokenizerManager calls. One instance per server."""

    def __init__(self, tokenizer_manager: Any, model_name: str, model_path: str, chat_template: JinjaChatTemplate,
                 max_top_logprobs: int, tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.tm = tokenizer_manager
        self.max_top_logprobs = max_top_logprobs        # --max-top-logprobs, as on /generate
        self.model_name = model_name
        self.model_path = model_path
        self.chat_template = chat_template
        self.created = int(time.time())
        self.tool_parser = get_tool_call_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.history = GeneratedHistory(tokenizer_manager.tokenizer, int(getattr(tokenizer_manager, "vocab_size", 0)
                                                                         or len(tokenizer_manager.tokenizer)))

    # ------------------------------------------------------------------ models
    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "radixlm",
                "root": self.model_path, "parent": None, "max_model_len": self.tm.context_len}

    def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def retrieve_model(self, model_id: str) -> dict[str, Any]:
        if model_id not in (self.model_name, self.model_path):
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return self.model_card()

    # ------------------------------------------------------------------ completions
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        _refuse_dangerous(req.model_extra or {})
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        n = _check_n(req.n)
        if req.best_of is not None and req.best_of != n:
            raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
        top = req.logprobs
        if top is not None and not 0 <= top <= self.max_top_logprobs:
            raise APIError(400, f"logprobs must be in [0, {self.max_top_logprobs}]", param="logprobs")
        prompts, is_batch = _split_prompt(req.prompt)
        max_new = _check_max_tokens(req.max_tokens, "max_tokens")
        max_new = max_new if max_new is not None else self._room(self._longest(prompts))
        params = _sampling_params(req, max_new, n)
        return_logprob = top is not None
        obj = _generate_input(prompts, is_batch, params, req, return_logprob=return_logprob,
                              logprob_start_len=0 if (return_logprob and req.echo) else -1, top=top or 0)
        meta = _ResponseMeta("cmpl-", self.model_name, n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = await start_stream(self.tm.generate(obj, raw))
            echo = self._echo_texts(prompts, bool(req.echo))
            return SSEResponse(completion_stream(stream, meta, echo, return_logprob, include_usage))
        items = await self._run(obj, raw)
        echo = self._echo_texts(prompts, bool(req.echo))
        choices = [completion_choice(it, choice_index(it, k), echo[choice_index(it, k) // n], return_logprob)
                   for k, it in enumerate(items)]
        return json_response({"id": meta.id, "object": "text_completion", "created": meta.created,
                      "model": self.model_name, "choices": choices, "usage": usage_of(items, n)})

    def _echo_texts(self, prompts: list[str | list[int]], echo: bool) -> list[str]:
        """The prompt texts to echo. Call it only after the TokenizerManager accepted the request:
        it checks token ids (decoding an out-of-vocab id raises OverflowError, a 500)."""
        return [(p if isinstance(p, str) else self.tm.tokenizer.decode(p)) if echo else "" for p in prompts]

    def _room(self, prompt_len: int) -> int:
        """max_tokens null: all the room the context (and the KV pool) leaves after the prompt."""
        limit = min(self.tm.context_len, int(self.tm.scheduler_info.get("max_total_tokens") or 1 << 62))
        return max(1, limit - prompt_len)

    def _longest(self, prompts: list[str | list[int]]) -> int:
        return max(len(p) if isinstance(p, list) else len(self.tm.tokenizer(p)["input_ids"]) for p in prompts)

    # ------------------------------------------------------------------ chat
    async def chat_completions(self, req: ChatCompletionRequest, raw: Request) -> Response:
        _refuse_dangerous(req.model_extra or {})
        n = _check_n(req.n)
        top = req.top_logprobs
        if top is not None and not 0 <= top <= self.max_top_logprobs:
            raise APIError(400, f"top_logprobs must be in [0, {self.max_top_logprobs}]", param="top_logprobs")
        if top and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = setup_tools(req, self.tool_parser, self.reasoning)
        prompt = encode_chat_prompt(self.chat_template, self.tm.tokenizer, self._chat_input(req, tools.tools))
        input_ids = self.history.encode(prompt)
        context = self.tm.context_len
        if len(input_ids) >= context:
            raise APIError(400, f"The prompt is {len(input_ids)} tokens long; the context length is {context} "
                                f"and leaves no room for output", param="messages", code="context_length_exceeded")
        max_new = _check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
        max_new = max_new if max_new is not None else _check_max_tokens(req.max_tokens, "max_tokens")
        params = _sampling_params(req, max_new if max_new is not None else self._room(len(input_ids)), n)
        constrain_after_reasoning(params, req, self.reasoning)
        if tools.constraint is not None:
            params["regex"] = tools.constraint
        parser = output_parser(tools, self.tool_parser, self.reasoning, req.separate_reasoning is not False)
        obj = _generate_input([input_ids], False, params, req, return_logprob=bool(req.logprobs),
                              logprob_start_len=-1, top=top or 0)
        meta = _ResponseMeta("chatcmpl-", self.model_name, n)

        def remember(item: dict[str, Any]) -> None:
            if is_complete(item):
                self.history.record(prompt.text, input_ids, list(item.get("output_ids") or []))

        if req.stream:
            if req.return_token_ids:
                raise APIError(400, "return_token_ids is not supported with stream", param="return_token_ids")
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            stream = await start_stream(self.tm.generate(obj, raw))
            return SSEResponse(chat_stream(stream, meta, bool(req.logprobs), include_usage, parser, remember))
        items = await self._run(obj, raw)
        for it in items:
            remember(it)
        choices = [chat_choice(it, choice_index(it, k), bool(req.logprobs), parser) for k, it in enumerate(items)]
        body = {"id": meta.id, "object": "chat.completion", "created": meta.created, "model": self.model_name,
                "choices": choices, "usage": usage_of(items, n), "system_fingerprint": None}
        if req.return_token_ids:   # vLLM's field: the exact ids the model saw and wrote
            body["prompt_token_ids"] = input_ids
            for choice, it in zip(choices, items):
                choice["token_ids"] = list(it.get("output_ids") or [])
        return json_response(body)

    def _chat_input(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> ChatRequestInput:
        """The template's inputs; ValueError (400) for messages or fields it cannot take."""
        messages = normalize_messages([m.model_dump(exclude_none=True) for m in req.messages], self.chat_template)
        cont = bool(req.continue_final_message)
        if cont and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        add_prompt = req.add_generation_prompt is not False and not cont
        return ChatRequestInput(messages, tools, add_prompt, cont, dict(req.chat_template_kwargs or {}))

    async def _run(self, obj: GenerateReqInput, raw: Request) -> list[dict[str, Any]]:
        out = await only_item(self.tm.generate(obj, raw))
        return out if isinstance(out, list) else [out]


# ---------------------------------------------------------------------- helpers
class _ResponseMeta:
    """The id/created/model every object (or chunk) of one response shares."""

    def __init__(self, prefix: str, model: str, n: int):
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.n = n


def _check_max_tokens(value: int | None, name: str) -> int | None:
    if value is not None and value < 0:
        raise APIError(400, f"{name} must be >= 0", param=name)
    return value


def _check_n(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= 128:
        raise APIError(400, "n must be in [1, 128]", param="n")
    return n


def _refuse_dangerous(extra: dict[str, Any]) -> None:
    """Unknown fields are ignored, except those whose silent dropping would mislead the client."""
    for name in ("audio", "prediction"):
        if extra.get(name):
            raise APIError(400, f"{name} is not supported by this server", param=name)


def _split_prompt(prompt: Any) -> tuple[list[str | list[int]], bool]:
    if isinstance(prompt, str):
        return [prompt], False
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)], False
    if any(isinstance(p, list) and not p for p in prompt):
        raise APIError(400, "prompt token lists must not be empty", param="prompt")
    return list(prompt), True


def _sampling_params(req: Any, max_new_tokens: int, n: int) -> dict[str, Any]:
    """OpenAI names -> SamplingParams names; only fields the client set (None means default)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "n": n, "stop": req.stop, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p, "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty, "repetition_penalty": req.repetition_penalty,
        "min_new_tokens": req.min_tokens, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": req.no_stop_trim,
        "spaces_between_special_tokens": req.spaces_between_special_tokens, "regex": req.regex,
        "json_schema": req.json_schema, "ebnf": req.ebnf, "logit_bias": req.logit_bias,
        "sampling_seed": req.seed,
    }
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            params["json_schema"] = JSON_OBJECT_SCHEMA
        else:
            schema = fmt.json_schema.schema_ if fmt.json_schema else None
            if schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema",
                               param="response_format")
            params["json_schema"] = json.dumps(schema)
    return {k: v for k, v in params.items() if v is not None}


def _generate_input(prompts: list[str | list[int]], is_batch: bool, params: dict[str, Any], req: Any, *,
                    return_logprob: bool, logprob_start_len: int, top: int) -> GenerateReqInput:
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and len(texts) != len(prompts):
        raise APIError(400, "prompt must be all strings or all token lists", param="prompt")
    value: Any = prompts if is_batch else prompts[0]
    return GenerateReqInput(
        text=value if texts else None, input_ids=None if texts else value, sampling_params=params,
        rid=req.rid, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
        top_logprobs_num=top, return_text_in_logprobs=True, stream=bool(req.stream), priority=req.priority)
