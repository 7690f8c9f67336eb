"""Executes programs: one `StreamExecutor` (a worker thread) per program state.

`s += expr` only queues `expr`; the worker executes queued expressions in order and sets one
event per variable when its value is known, so `s[name]` blocks only until that value exists.
Independent states (run_batch, forks) therefore send their requests concurrently and the server
batches them. `PromptBuilder` holds the text/role/message bookkeeping that the tracer reuses.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from .backend.base import BaseBackend
from .chat_template import ChatTemplate
from .ir import (
    SglConstantText,
    SglExpr,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
    leaves,
    produced_var_names,
)

_END = object()  # queue sentinel: the program will submit nothing more


class PromptBuilder:
    """The prompt text, the finished chat messages, the open role and the variables."""

    def __init__(self, chat_template: ChatTemplate) -> None:
        self.chat_template = chat_template
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.var_scope_begin: dict[str, int] = {}

    def copy_prompt_from(self, other: PromptBuilder) -> None:
        self.text_ = other.text_
        self.messages_ = [dict(m) for m in other.messages_]
        self.cur_role, self.cur_role_begin_pos = other.cur_role, other.cur_role_begin_pos
        self.variables = dict(other.variables)
        self.meta_info = dict(other.meta_info)
        self.var_scope_begin = dict(other.var_scope_begin)

    def fill(self, text: str) -> None:
        self.text_ += text

    def role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"Cannot begin role {role!r} inside role {self.cur_role!r}: roles do not nest")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self.role_begin("system")
            self.fill(self.chat_template.default_system_prompt)
            self.role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.fill(prefix)
        self.cur_role, self.cur_role_begin_pos = role, len(self.text_)

    def role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end() without a matching {role}_begin() (open role: {self.cur_role!r})")
        content = self.text_[self.cur_role_begin_pos:]
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    def execute_structural(self, leaf: SglExpr) -> bool:
        """Executes text, role and var-scope nodes; False for nodes that need a backend."""
        if isinstance(leaf, SglConstantText):
            self.fill(leaf.value)
        elif isinstance(leaf, SglRoleBegin):
            self.role_begin(leaf.role)
        elif isinstance(leaf, SglRoleEnd):
            self.role_end(leaf.role)
        elif isinstance(leaf, SglVarScopeBegin):
            self.var_scope_begin[leaf.name] = len(self.text_)
        elif isinstance(leaf, SglVarScopeEnd):
            self.variables[leaf.name] = self.text_[self.var_scope_begin.pop(leaf.name):]
        else:
            return False
        return True


class StreamExecutor(PromptBuilder):
    """Runs the expressions of one program state in a worker thread, in submission order."""

    def __init__(self, backend: BaseBackend, default_params: SglSamplingParams, stream: bool = False,
                 fork_of: StreamExecutor | None = None) -> None:
        """A root state gets a new session cursor (its session is closed when the root ends, after
        its forks); a fork (`fork_of` its parent) branches its parent's."""
        super().__init__(backend.get_chat_template())
        self.backend = backend
        self.owns_session = fork_of is None
        if fork_of is None:
            self.session_ = backend.new_session_cursor()
        else:
            self.session_ = fork_of.session_.branch() if fork_of.session_ is not None else None
        self.default_params = default_params
        self.stream = stream
        self.error_: BaseException | None = None
        self.finished = False        # the worker has executed everything and exited
        self.variable_event: dict[str, threading.Event] = {}
        self.cond = threading.Condition()  # guards text/variables for streaming readers
        self.children: list[StreamExecutor] = []
        self._queue: queue.Queue[Any] = queue.Queue()
        self._ended = False
        self._worker = threading.Thread(target=self._work, name="radixlm-program", daemon=True)
        self._worker.start()

    # ----------------------------------------------------------- submission
    def submit(self, expr: SglExpr) -> None:
        if self._ended:
            raise RuntimeError("This program state has ended; it accepts no more expressions")
        with self.cond:  # the worker may be iterating over the events (after an error)
            for name in produced_var_names(expr):
                self.variable_event[name] = threading.Event()
        self._queue.put(expr)

    def end(self) -> None:
        """No more submissions; the worker exits after the queued work (children end too)."""
        for child in self.children:
            child.end()
        if not self._ended:
            self._ended = True
            self._queue.put(_END)

    def sync(self) -> None:
        """Blocks until everything submitted so far has executed."""
        self._queue.join()

    def sync_all(self) -> BaseException | None:
        """Syncs this executor and every fork below it; returns the first error among them."""
        self.sync()
        errors = [self.error_] + [child.sync_all() for child in self.children]
        return next((e for e in errors if e is not None), None)

    # -------------------------------------------------------------- reading
    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        else:
            self.sync()
        if name not in self.variables and self.error_ is not None:
            raise self.error_
        return self.variables[name]

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    def set_var(self, name: str, value: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.cond.notify_all()

    def wait_for_change(self, var_name: str | None, seen: int, timeout: float | None = None) -> tuple[Any, bool]:
        """(current value, done) once the text (or variable) is longer than `seen` chars or final."""
        with self.cond:
            while True:
                if var_name is None:
                    value, done = self.text_, self.finished
                else:
                    event = self.variable_event.get(var_name)
                    value = self.variables.get(var_name, "")
                    done = self.finished or (event is not None and event.is_set())
                if len(value) > seen or done or self.error_ is not None:
                    return value, done or self.error_ is not None
                if not self.cond.wait(timeout):
                    return value, False

    # ---------------------------------------------------------------- forks
    def fork(self, size: int) -> list[StreamExecutor]:
        """`size` executors continuing from the current prompt; the shared prefix is cached first."""
        self.sync()
        if self.error_ is not None:
            raise self.error_
        if size > 1 and self.text_:
            self.backend.cache_fork_prefix(self)
        forks = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.default_params, self.stream, fork_of=self)
            child.copy_prompt_from(self)
            forks.append(child)
        self.children.extend(forks)
        return forks

    # --------------------------------------------------------------- worker
    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    self._close_session()
                    return
                if self.error_ is None:
                    for leaf in leaves(expr):
                        self._execute(leaf)
            except BaseException as exc:  # recorded; readers re-raise it
                self.error_ = exc
            finally:
                if expr is _END or self.error_ is not None:
                    self._release_waiters(final=expr is _END)
                self._queue.task_done()

    def _close_session(self) -> None:
        """The root state closes the program's server session once every fork has finished."""
        if self.owns_session and self.session_ is not None:
            for child in self.children:
                child.sync_all()
            self.session_.session.close()

    def _release_waiters(self, final: bool) -> None:
        with self.cond:
            for event in self.variable_event.values():
                event.set()
            self.finished = self.finished or final
            self.cond.notify_all()

    def _execute(self, leaf: SglExpr) -> None:
        with self.cond:
            handled = self.execute_structural(leaf)
            self.cond.notify_all()
        if handled:
            if isinstance(leaf, SglVarScopeEnd) and leaf.name in self.variable_event:
                self.variable_event[leaf.name].set()
        elif isinstance(leaf, SglGen):
            self._execute_gen(leaf)
        elif isinstance(leaf, SglSelect):
            self._execute_select(leaf)
        else:
            raise TypeError(f"Cannot execute {leaf!r}")

    def _resolve_params(self, overrides: SglSamplingParams) -> SglSamplingParams:
        params = self.default_params.merged(overrides).resolve_dtype()
        if self.chat_template.stop_str:
            params = params.with_extra_stop(self.chat_template.stop_str)
        return params

    def _execute_gen(self, expr: SglGen) -> None:
        """Runs one gen. n > 1: the variable is the list of n outputs (the prompt continues with the
        first); separate_reasoning: the variable(s) are split after the output is complete."""
        params = self._resolve_params(expr.sampling_params)
        if (params.n or 1) > 1:
            if self.stream:
                raise ValueError("gen(n > 1) cannot stream; run the program without stream=True")
            texts, metas = self.backend.generate(self, params)
            if not isinstance(texts, list):
                texts, metas = [texts], [metas]
            with self.cond:
                self.text_ += texts[0]
                if expr.name is not None:
                    self.variables[expr.name] = list(texts)
                    self.meta_info[expr.name] = list(metas)
                self.cond.notify_all()
        elif not self.stream:
            text, meta = self.backend.generate(self, params)
            self._append_output(expr.name, text, meta, first=True)
        else:
            first = True
            for delta, meta in self.backend.generate_stream(self, params):
                self._append_output(expr.name, delta, meta, first)
                first = False
            if first:  # an empty stream still defines the variable
                self._append_output(expr.name, "", {}, first=True)
        if expr.reasoning_name:
            self._separate_reasoning(expr)
        if expr.name is not None:
            self.variable_event[expr.name].set()

    def _separate_reasoning(self, expr: SglGen) -> None:
        from ..runtime.parsers import get_reasoning_parser

        parser = get_reasoning_parser(expr.reasoning_model_type or "")
        value = self.variables[expr.name]
        splits = [parser.scan(v, final=True) for v in (value if isinstance(value, list) else [value])]
        with self.cond:
            if isinstance(value, list):
                self.variables[expr.name] = [sp.content for sp in splits]
                self.variables[expr.reasoning_name] = [sp.reasoning for sp in splits]
            else:
                self.variables[expr.name] = splits[0].content
                self.variables[expr.reasoning_name] = splits[0].reasoning
            self.cond.notify_all()
        self.variable_event[expr.reasoning_name].set()

    def _append_output(self, name: str | None, text: str, meta: dict[str, Any], first: bool) -> None:
        with self.cond:
            self.text_ += text
            if name is not None:
                self.variables[name] = text if first else self.variables[name] + text
                self.meta_info[name] = meta
            self.cond.notify_all()

    def _execute_select(self, expr: SglSelect) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        with self.cond:
            self.text_ += decision.decision
            if expr.name is not None:
                self.variables[expr.name] = decision.decision
                self.meta_info[expr.name] = decision.meta_info
            self.cond.notify_all()
        if expr.name is not None:
            self.variable_event[expr.name].set()


# ---------------------------------------------------------------- running programs
def run_program(func: Callable[..., Any], backend: BaseBackend, args: tuple, kwargs: dict[str, Any],
                default_params: SglSamplingParams, stream: bool = False, raise_errors: bool = True) -> Any:
    """Runs one program. Not streaming: returns after every request finished (and raises the first
    backend error). Streaming: returns at once; read the state with text_iter()."""
    from .state import ProgramState

    executor = StreamExecutor(backend, default_params, stream=stream)
    state = ProgramState(executor)
    if stream:
        threading.Thread(target=_run_body, args=(state, func, args, kwargs), daemon=True).start()
        return state
    _run_body(state, func, args, kwargs)
    error = executor.sync_all()
    if raise_errors and error is not None:
        raise error
    return state


def _run_body(state: Any, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    try:
        state.ret_value = func(state, *args, **kwargs)
    finally:
        state.stream_executor.end()


def resolve_num_threads(num_threads: int | str, num_programs: int) -> int:
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive int, not {num_threads!r}")
    return max(1, min(num_threads, num_programs))


def run_program_batch(func: Callable[..., Any], backend: BaseBackend, batch_kwargs: list[dict[str, Any]],
                      default_params: SglSamplingParams, num_threads: int | str = "auto",
                      progress_bar: bool = False, generator_style: bool = False) -> Any:
    """Runs one program per kwargs dict on a thread pool; returns the states in input order.
    A backend error is kept in its state (`state.error()`; reading its variables re-raises it)."""
    workers = resolve_num_threads(num_threads, len(batch_kwargs))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="radixlm-batch")
    futures = [pool.submit(run_program, func, backend, (), kw, default_params, False, False)
               for kw in batch_kwargs]
    if generator_style:
        return _yield_in_order(pool, futures, progress_bar)
    try:
        _wait_with_progress(futures, progress_bar)
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True)


def _wait_with_progress(futures: list[Any], progress_bar: bool) -> None:
    if not progress_bar:
        return
    from tqdm.auto import tqdm

    with tqdm(total=len(futures), desc="run_batch") as bar:
        for _ in as_completed(futures):
            bar.update(1)


def _yield_in_order(pool: ThreadPoolExecutor, futures: list[Any], progress_bar: bool) -> Iterator[Any]:
    bar = None
    if progress_bar:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(futures), desc="run_batch")
    try:
        for future in futures:
            yield future.result()
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        pool.shutdown(wait=True)
