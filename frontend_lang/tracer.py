"""Runs a program without a backend to see the shape of its prompt.

Arguments are replaced by placeholder strings that carry private-use marker characters
(`\\ue000name\\ue001`), so the usual ways of building text (`+`, f-strings, `.format`, `join`) keep
them visible; generated values become `\\ue002name\\ue001`. The traced text, split at the markers,
tells which part of the prompt is constant across calls: `run_batch` caches that prefix once,
and lint.py warns when argument text sits in front of a long constant segment.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from .chat_template import ChatTemplate
from .interpreter import PromptBuilder
from .ir import SglExpr, SglGen, SglSelect, leaves, to_expr
from .state import RoleMethods

ARG_OPEN, GEN_OPEN, MARK_CLOSE = "\ue000", "\ue002", "\ue001"
_MARKERS = (ARG_OPEN, GEN_OPEN, MARK_CLOSE)


class StopTracing(Exception):
    """Raised inside a traced program to end the trace early (at a fork or the first generation)."""


class Placeholder(str):
    """The value an argument takes while tracing: a str that marks where it lands in the prompt."""

    def __new__(cls, name: str) -> Placeholder:
        return super().__new__(cls, f"{ARG_OPEN}{name}{MARK_CLOSE}")


@dataclass
class Segment:
    kind: Literal["constant", "argument", "generated"]
    start: int  # [start, end) in the traced text
    end: int
    name: str | None = None


@dataclass
class Insertion:
    """One `s += ...` call: where its text landed and which source line did it."""

    start: int
    end: int
    filename: str
    lineno: int


@dataclass
class TraceResult:
    text: str                              # the traced prompt, markers included
    nodes: list[SglExpr] = field(default_factory=list)
    insertions: list[Insertion] = field(default_factory=list)
    stopped: str | None = None             # why tracing ended early (None: ran to the end)

    @property
    def constant_prefix(self) -> str:
        """The text before the first argument-dependent or generated character."""
        cut = min((i for i in (self.text.find(m) for m in _MARKERS) if i >= 0), default=len(self.text))
        return self.text[:cut]

    def segments(self) -> list[Segment]:
        return split_segments(self.text)

    def insertion_at(self, pos: int) -> Insertion | None:
        return next((ins for ins in self.insertions if ins.start <= pos < max(ins.end, ins.start + 1)), None)


def split_segments(text: str) -> list[Segment]:
    """Splits traced text into constant runs and marked (argument / generated) spans."""
    out: list[Segment] = []
    pos = 0
    while pos < len(text):
        opens = [i for i in (text.find(ARG_OPEN, pos), text.find(GEN_OPEN, pos), text.find(MARK_CLOSE, pos))
                 if i >= 0]
        mark = min(opens, default=len(text))
        if mark > pos:
            out.append(Segment("constant", pos, mark))
        if mark == len(text):
            break
        close = text.find(MARK_CLOSE, mark + 1) if text[mark] != MARK_CLOSE else mark
        end = close + 1 if close >= 0 else mark + 1
        kind = "generated" if text[mark] == GEN_OPEN else "argument"
        name = text[mark + 1:close] if close > mark else None
        out.append(Segment(kind, mark, end, name))
        pos = end
    return out


class TracingState(PromptBuilder, RoleMethods):
    """Stands in for ProgramState during tracing: same methods, no backend."""

    def __init__(self, chat_template: ChatTemplate, stop_at_generation: bool) -> None:
        super().__init__(chat_template)
        self.stop_at_generation = stop_at_generation
        self.nodes: list[SglExpr] = []
        self.insertions: list[Insertion] = []
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> TracingState:
        expr = to_expr(other)
        start = len(self.text_)
        filename, lineno = _caller_location()
        try:
            for leaf in leaves(expr):
                self._trace_leaf(leaf)
        finally:
            self.insertions.append(Insertion(start, len(self.text_), filename, lineno))
        return self

    def _trace_leaf(self, leaf: SglExpr) -> None:
        self.nodes.append(leaf)
        if self.execute_structural(leaf):
            return
        if isinstance(leaf, (SglGen, SglSelect)):
            if self.stop_at_generation:
                raise StopTracing("generation")
            marker = f"{GEN_OPEN}{leaf.name or 'gen'}{MARK_CLOSE}"
            self.fill(marker)
            if leaf.name is not None:
                self.variables[leaf.name] = marker

    # the rest of the ProgramState surface a program may touch while being traced (roles: RoleMethods)
    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        start = len(self.text_)
        yield
        self.variables[name] = self.text_[start:]

    def __getitem__(self, name: str) -> Any:
        return self.variables.get(name, f"{GEN_OPEN}{name}{MARK_CLOSE}")

    def __setitem__(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    get_var = __getitem__
    set_var = __setitem__

    def get_meta_info(self, name: str) -> dict[str, Any]:
        return {}

    def text(self) -> str:
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        return self.messages_

    def sync(self) -> None:
        pass

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> Any:
        raise StopTracing("fork")


def _caller_location() -> tuple[str, int]:
    """The first stack frame outside the DSL package (the program's own `s += ...` line)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame = frame.f_back
    if frame is None:
        return "?", 0
    return frame.f_code.co_filename, frame.f_lineno


def placeholder_arguments(func: Callable[..., Any], given: dict[str, Any], dynamic: set[str] | None = None
                          ) -> dict[str, Any]:
    """Keyword arguments for tracing: `given` values, placeholders for `dynamic` names and for
    parameters without a default; other defaulted parameters keep their default."""
    params = list(inspect.signature(func).parameters.values())[1:]  # skip `s`
    out: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in given:
            out[p.name] = given[p.name]
        elif (dynamic is not None and p.name in dynamic) or p.default is p.empty:
            out[p.name] = Placeholder(p.name)
    return out


def trace_program(func: Callable[..., Any], kwargs: dict[str, Any], chat_template: ChatTemplate,
                  stop_at_generation: bool = False) -> TraceResult:
    """Runs `func(state, **kwargs)` on a TracingState. Tracing never raises: an exception in the
    program ends the trace and is recorded in `stopped` (the text so far is still exact)."""
    state = TracingState(chat_template, stop_at_generation)
    stopped: str | None = None
    try:
        state.ret_value = func(state, **kwargs)
    except StopTracing as stop:
        stopped = str(stop)
    except Exception as exc:  # noqa: BLE001 - a program that cannot run on placeholders
        stopped = f"{type(exc).__name__}: {exc}"
    return TraceResult(state.text_, state.nodes, state.insertions, stopped)


def common_prefix(a: str, b: str) -> str:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]


def batch_shared_prefix(func: Callable[..., Any], batch_kwargs: list[dict[str, Any]],
                        chat_template: ChatTemplate, sample: int = 4) -> tuple[str, TraceResult]:
    """The prompt prefix every call of the batch starts with, and the placeholder trace.

    The placeholder trace gives the candidate; a few real calls (traced up to their first
    generation, no backend) then trim it, which guards against argument-dependent branches."""
    dynamic = {name for kw in batch_kwargs for name in kw}
    trace = trace_program(func, placeholder_arguments(func, {}, dynamic), chat_template)
    prefix = trace.constant_prefix
    step = max(1, len(batch_kwargs) // sample)
    for kw in batch_kwargs[::step][:sample]:
        if not prefix:
            break
        real = trace_program(func, placeholder_arguments(func, kw), chat_template, stop_at_generation=True)
        prefix = common_prefix(prefix, real.constant_prefix)
    return prefix, trace
