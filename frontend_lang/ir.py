"""The DSL's intermediate representation: the expression nodes a program appends to its state.

`s += "text" + gen("x")` builds an `SglExprList([SglConstantText, SglGen])`; the interpreter
(interpreter.py) executes the leaves in order, and the tracer (tracer.py) records them. Sampling
parameters travel as `SglSamplingParams`: `run()` gives the defaults, `gen()` the overrides, and
`merged()` combines the two the way SGLang does (a non-None override wins).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from typing_extensions import Unpack

# Regexes that `gen(dtype=...)` turns into constrained decoding (the same shapes as SGLang's).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_REGEX: dict[str, str] = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}

# Fields sent inside `sampling_params` (None values are left out so the server applies its defaults).
_SRT_FIELDS = (
    "max_new_tokens", "min_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
    "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "regex",
    "json_schema",
)
# Fields sent at the top level of the /generate body.
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


@dataclass
class SglSamplingParams:
    """Sampling parameters of one generation; None means "not set here"."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: type | str | None = None
    regex: str | None = None
    json_schema: str | dict | None = None

    def merged(self, overrides: SglSamplingParams) -> SglSamplingParams:
        """A copy of self where every field set (non-None) in `overrides` wins."""
        changes = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)
                   if getattr(overrides, f.name) is not None}
        return dataclasses.replace(self, **changes)

    def stop_list(self) -> list[str]:
        if not self.stop:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def with_extra_stop(self, extra: tuple[str, ...] | list[str]) -> SglSamplingParams:
        stops = self.stop_list()
        stops += [s for s in extra if s not in stops]
        return dataclasses.replace(self, stop=stops)

    def resolve_dtype(self) -> SglSamplingParams:
        """Turns `dtype` into a regex constraint (int and float also stop at a space or newline)."""
        if self.dtype is None:
            return self
        name = self.dtype if isinstance(self.dtype, str) else getattr(self.dtype, "__name__", "")
        if name not in _DTYPE_REGEX:
            raise ValueError(f"Unsupported dtype {self.dtype!r}; use int, float, bool or str")
        params = dataclasses.replace(self, regex=_DTYPE_REGEX[name], dtype=None)
        return params.with_extra_stop([" ", "\n"]) if name in ("int", "float") else params

    def to_srt_kwargs(self) -> dict[str, Any]:
        """The `sampling_params` object of a native /generate request."""
        out: dict[str, Any] = {}
        for name in _SRT_FIELDS:
            value = getattr(self, name)
            if value is None or (name in ("stop", "stop_token_ids") and not value):
                continue
            out[name] = list(value) if isinstance(value, tuple) else value
        if isinstance(out.get("json_schema"), dict):
            out["json_schema"] = json.dumps(out["json_schema"])
        return out

    def logprob_kwargs(self) -> dict[str, Any]:
        """The top-level logprob fields of a /generate request (only those set)."""
        return {name: getattr(self, name) for name in LOGPROB_FIELDS if getattr(self, name) is not None}


class RunSamplingArgs(TypedDict, total=False):
    """The sampling arguments of `run()` and `run_batch()` (SGLang's names); unset ones take the
    defaults of `default_sampling_params`."""

    max_new_tokens: int
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    ignore_eos: bool
    return_logprob: bool | None
    logprob_start_len: int | None
    top_logprobs_num: int | None
    return_text_in_logprobs: bool | None


RUN_SAMPLING_ARGS = frozenset(RunSamplingArgs.__annotations__)


def default_sampling_params(**kwargs: Unpack[RunSamplingArgs]) -> SglSamplingParams:
    """The run()-level defaults (SGLang's): 128 new tokens, temperature 1, no top-k/top-p/min-p,
    overridden by the non-None `kwargs`. TypeError for a name not in `RunSamplingArgs`."""
    unknown = sorted(set(kwargs) - RUN_SAMPLING_ARGS)
    if unknown:
        raise TypeError(f"unexpected sampling argument(s) {unknown}")
    base = SglSamplingParams(max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                             frequency_penalty=0.0, presence_penalty=0.0, ignore_eos=False)
    return base.merged(SglSamplingParams(**kwargs))


# ------------------------------------------------------------------ expressions
class SglExpr:
    """Base of every node; `+` with a str or another node builds an `SglExprList`."""

    def __add__(self, other: Any) -> SglExprList:
        return SglExprList([*leaves(self), *leaves(to_expr(other))])

    def __radd__(self, other: Any) -> SglExprList:
        return SglExprList([*leaves(to_expr(other)), *leaves(self)])


class SglExprList(SglExpr):
    def __init__(self, expr_list: list[SglExpr]) -> None:
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglGen(SglExpr):
    """One generation into variable `name`. With `reasoning_model_type` (set by separate_reasoning)
    the output is split: `name` gets the content, `name + "_reasoning_content"` the reasoning."""

    def __init__(self, name: str | None, sampling_params: SglSamplingParams,
                 reasoning_model_type: str | None = None) -> None:
        self.name = name
        self.sampling_params = sampling_params
        self.reasoning_model_type = reasoning_model_type

    @property
    def reasoning_name(self) -> str | None:
        return f"{self.name}_reasoning_content" if self.name and self.reasoning_model_type else None

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    def __init__(self, name: str | None, choices: list[str], temperature: float, choices_method: Any) -> None:
        if not choices or any(not isinstance(c, str) or c == "" for c in choices):
            raise ValueError("select needs a non-empty list of non-empty strings as choices")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    """Starts capturing the appended text into variable `name` (see ProgramState.var_scope)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeBegin({self.name})"


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeEnd({self.name})"


def to_expr(value: Any) -> SglExpr:
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    if value is None:
        raise ValueError("Tried to append None to a program state")
    raise TypeError(f"Can only append str or DSL expressions to a program state, not {type(value).__name__}")


def leaves(expr: SglExpr) -> Iterator[SglExpr]:
    """The non-list nodes of `expr`, in order."""
    if isinstance(expr, SglExprList):
        for child in expr.expr_list:
            yield from leaves(child)
    else:
        yield expr


def produced_var_names(expr: SglExpr) -> list[str]:
    """Names of the variables that executing `expr` will set."""
    names = []
    for leaf in leaves(expr):
        if isinstance(leaf, (SglGen, SglSelect, SglVarScopeBegin)) and leaf.name is not None:
            names.append(leaf.name)
        if isinstance(leaf, SglGen) and leaf.reasoning_name:
            names.append(leaf.reasoning_name)
    return names
