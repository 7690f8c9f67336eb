"""The public DSL: `@function`, `gen`, `select`, roles, and backend helpers (SGLang's names and arguments).

    import radixlm as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .backend.base import resolve_backend, set_default_backend
from .backend.openai import OpenAI
from .backend.runtime import Runtime
from .backend.runtime_endpoint import RuntimeEndpoint
from .choices import (
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from .function import SglFunction
from .ir import (
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    leaves,
    to_expr,
)

__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "separate_reasoning",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end",
    "set_default_backend", "flush_cache", "get_server_info",
    "RuntimeEndpoint", "Runtime", "OpenAI",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
]


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: `@function` or `@function(num_api_spec_tokens=...)` (the latter is accepted and unused)."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f: Callable[..., Any]) -> SglFunction:
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
) -> SglExpr:
    """Generates text into variable `name`; unset arguments fall back to the run() defaults.
    With `choices`, this is `select`."""
    if choices:
        return SglSelect(name, choices, 0.0 if temperature is None else temperature,
                         choices_method or token_length_normalized)
    if regex is not None:
        re.compile(regex)  # fail early on an invalid pattern
    return SglGen(name, SglSamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema,
    ))


def separate_reasoning(expr: SglExpr, model_type: str = "qwen3") -> SglExpr:
    """Splits the output of the named `gen` in `expr`: `s[name]` gets the content and
    `s[name + "_reasoning_content"]` the reasoning (model_type: a --reasoning-parser name such as
    qwen3 or deepseek-r1). The prompt text keeps the output as generated."""
    from ..runtime.parsers import get_reasoning_parser

    get_reasoning_parser(model_type)   # ValueError naming the choices
    items = list(leaves(to_expr(expr)))
    gens = [k for k, leaf in enumerate(items) if isinstance(leaf, SglGen) and leaf.name]
    if not gens:
        raise ValueError("separate_reasoning needs a named gen(...) in its expression")
    k = gens[-1]
    gen_expr = items[k]
    items[k] = SglGen(gen_expr.name, gen_expr.sampling_params, reasoning_model_type=model_type)
    return SglExprList(items)


def _typed_gen(dtype: type, fn_name: str, doc: str) -> Callable[..., SglExpr]:
    """`gen(dtype=dtype)` as a function of its own (gen_int, gen_string), with gen's arguments
    but min_tokens, dtype, choices, choices_method, regex and json_schema."""

    def typed_gen(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
                  stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                  stop_regex: str | list[str] | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                  frequency_penalty: float | None = None, presence_penalty: float | None = None,
                  ignore_eos: bool | None = None, return_logprob: bool | None = None,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None) -> SglExpr:
        kwargs = {k: v for k, v in locals().items() if k not in ("name", "dtype")}
        return gen(name, dtype=dtype, **kwargs)

    typed_gen.__name__ = typed_gen.__qualname__ = fn_name
    typed_gen.__doc__ = doc
    return typed_gen


gen_int = _typed_gen(int, "gen_int", "`gen(dtype=int)`: an integer (the variable holds its text).")
gen_string = _typed_gen(str, "gen_string", "`gen(dtype=str)`: a double-quoted string.")


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> SglExpr:
    """Appends the choice the model scores highest (mean token logprob); the scores are in
    `s.get_meta_info(name)`."""
    if choices is None:
        raise ValueError("select needs choices")
    return SglSelect(name, choices, temperature, choices_method)


def _role(role: str, expr: Any | None) -> SglExpr:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglExprList([SglRoleBegin(role), to_expr(expr), SglRoleEnd(role)])


def system(expr: Any | None = None) -> SglExpr:
    return _role("system", expr)


def user(expr: Any | None = None) -> SglExpr:
    return _role("user", expr)


def assistant(expr: Any | None = None) -> SglExpr:
    return _role("assistant", expr)


def system_begin() -> SglExpr:
    return SglRoleBegin("system")


def system_end() -> SglExpr:
    return SglRoleEnd("system")


def user_begin() -> SglExpr:
    return SglRoleBegin("user")


def user_end() -> SglExpr:
    return SglRoleEnd("user")


def assistant_begin() -> SglExpr:
    return SglRoleBegin("assistant")


def assistant_end() -> SglExpr:
    return SglRoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    """Empties the server's prefix cache; False when there is no backend."""
    try:
        resolved = resolve_backend(backend)
    except ValueError:
        return False
    resolved.flush_cache()
    return True


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    try:
        resolved = resolve_backend(backend)
    except ValueError:
        return None
    return resolved.get_server_info()
