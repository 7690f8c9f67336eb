"""Request bodies of the HTTP API as pydantic models (they also make `/openapi.json` useful).

Every body here checks JSON types only (a wrong type is a 422 naming the field). OpenAI bodies ignore
unknown fields (clients send many), except the few whose silent dropping would change what the
client gets (`suffix`, `best_of` > n, `audio`, `prediction`): those are refused in openai_api.py.
The native `/generate` body also accepts unknown fields: SGLang's fields that radixlm does not
implement must be unset (request_validation.check_extra_fields, a 400 naming the field), and
fields SGLang does not know either are ignored. `/abort_request` forbids unknown fields. Value
checks (ranges, token limits) live in SamplingParams and managers/request_builder.py, which every
route goes through.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat
StopField = StrictStr | list[StrictStr] | None


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class JsonSchemaFormat(_Lenient):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingExtras(_Lenient):
    """Fields shared by completions and chat: OpenAI's, then the SGLang/vLLM extras."""

    model: StrictStr | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    temperature: Number | None = None
    top_p: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None
    response_format: ResponseFormat | None = None
    # extras
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: StrictInt | None = None
    regex: StrictStr | None = None
    json_schema: StrictStr | dict[str, Any] | None = None
    ebnf: StrictStr | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    rid: StrictStr | None = None
    priority: StrictInt | None = None


class CompletionRequest(_SamplingExtras):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ChatMessage(_Lenient):
    """Passed to the chat template as sent (extra fields too); see chat_template.normalize_messages."""

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None      # assistant
    tool_call_id: StrictStr | None = None                # tool
    reasoning_content: StrictStr | None = None           # assistant (reasoning models)


class ChatCompletionRequest(_SamplingExtras):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = True
    # vLLM / SGLang extras
    add_generation_prompt: StrictBool | None = True
    continue_final_message: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: StrictBool | None = True
    return_token_ids: StrictBool | None = False


class GenerateRequest(BaseModel):
    """The native `/generate` body, parsed into a GenerateReqInput (same fields). Fields radixlm does
    not implement land in `model_extra` and are checked by request_validation.check_extra_fields
    (SGLang's other fields must be unset; unknown ones are ignored)."""

    model_config = ConfigDict(extra="allow")

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: StrictStr | list[StrictStr] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    logprob_start_len: StrictInt | list[StrictInt] | None = None
    top_logprobs_num: StrictInt | list[StrictInt] | None = None
    return_text_in_logprobs: StrictBool | None = None
    stream: StrictBool | None = None
    priority: StrictInt | None = None
    timeout: Number | None = None
    session_params: dict[str, Any] | None = None


class OpenSessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    capacity_of_str_len: StrictInt
    session_id: StrictStr | None = None


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: StrictStr


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: StrictStr | None = None
    abort_all: StrictBool | None = False
