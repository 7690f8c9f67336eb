"""`ProgramState` (the `s` a program receives) and `ProgramStateGroup` (what `s.fork(n)` returns).

Both are thin, user-facing views over a `StreamExecutor`: `+=` submits, `s[name]` waits for
that variable, `text()`/`messages()` wait for everything submitted so far.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from .interpreter import StreamExecutor
from .ir import (
    SglExpr,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
    to_expr,
)


class RoleMethods:
    """`s.system/user/assistant(...)`, written once for ProgramState and the tracer's stand-in;
    both append with `+=`."""

    def _role(self, role: str, expr: Any | None) -> Any:
        if expr is None:
            return self._role_scope(role)
        self += SglRoleBegin(role) + to_expr(expr) + SglRoleEnd(role)
        return None

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += SglRoleBegin(role)
        yield
        self += SglRoleEnd(role)

    def system(self, expr: Any | None = None) -> Any:
        """`s.system(text)` appends a system message; `with s.system():` wraps what is appended."""
        return self._role("system", expr)

    def user(self, expr: Any | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any | None = None) -> Any:
        return self._role("assistant", expr)


class ProgramState(RoleMethods):
    """The state of one running program."""

    def __init__(self, stream_executor: StreamExecutor) -> None:
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ---------------------------------------------------------------- appending
    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(to_expr(other))
        return self

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block also becomes variable `name`."""
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The server's meta info for variable `name` (for select: the choice scores)."""
        return self.stream_executor.get_meta_info(name)

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.stream_executor.messages_

    def sync(self) -> None:
        self.stream_executor.sync()
        if self.stream_executor.error_ is not None:
            raise self.stream_executor.error_

    def error(self) -> BaseException | None:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def copy(self, position_ids_offset: list[int] | None = None) -> ProgramState:
        """An independent state continuing from the current prompt and variables (a fork of one)."""
        return self.fork(1, position_ids_offset)[0]

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ProgramStateGroup:
        """`size` states that continue from the current prompt (which is prefilled once, shared)."""
        if position_ids_offset is not None:
            raise NotImplementedError("position_ids_offset is not supported")
        children = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    # ---------------------------------------------------------------- streaming
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yields the text (or one variable) piece by piece as it is generated (run(stream=True));
        without streaming it yields the final value once."""
        executor = self.stream_executor
        if not executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        seen = 0
        while True:
            value, done = executor.wait_for_change(var_name, seen)
            if len(value) > seen:
                yield value[seen:]
                seen = len(value)
            if done:
                break
        if executor.error_ is not None:
            raise executor.error_

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False
                              ) -> AsyncIterator[Any]:
        """The async form of text_iter; with return_meta_data, yields (piece, meta info) pairs."""
        executor = self.stream_executor
        loop = asyncio.get_running_loop()
        if not executor.stream:
            def read() -> Any:
                return self.text() if var_name is None else self.get_var(var_name)

            value = await loop.run_in_executor(None, read)
            yield (value, executor.meta_info.get(var_name)) if return_meta_data else value
            return
        seen = 0
        while True:
            value, done = await loop.run_in_executor(None, executor.wait_for_change, var_name, seen, 0.5)
            if len(value) > seen:
                piece, seen = value[seen:], len(value)
                yield (piece, executor.meta_info.get(var_name)) if return_meta_data else piece
            if done:
                break
        if executor.error_ is not None:
            raise executor.error_

    def __del__(self) -> None:
        executor = self.__dict__.get("stream_executor")
        if executor is not None:
            executor.end()

    def __repr__(self) -> str:
        self.stream_executor.sync()
        return f"ProgramState({self.stream_executor.text_!r})"


class ProgramStateGroup:
    """The states returned by `fork`; `+=` appends to every branch, `join()` gathers variables."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState | None = None) -> None:
        self.states = states
        self.src_state = src_state

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise ValueError("forks[i] can only be updated in place (forks[i] += ...)")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"Got {len(other)} expressions for {len(self.states)} forks")
            for state, expr in zip(self.states, other, strict=True):
                state += expr
        else:
            expr: SglExpr = to_expr(other)
            for state in self.states:
                state += expr
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Waits for every branch; each variable a branch created becomes a list in the parent."""
        if mode != "gather_variable":
            raise NotImplementedError(f"join(mode={mode!r}) is not supported; use 'gather_variable'")
        if self.src_state is None:
            raise ValueError("This group has no parent state to join into")
        parent = self.src_state.stream_executor
        before = set(parent.variables)
        for state in self.states:
            state.sync()
            for name in state.stream_executor.variables.keys() - before:
                value = state.stream_executor.variables[name]
                parent.set_var(name, [*parent.variables.get(name, []), value])
