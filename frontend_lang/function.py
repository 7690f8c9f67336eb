"""`SglFunction`: what `@function` makes of `def prog(s, ...)`, with `run`, `run_batch` and `trace`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .backend.base import BaseBackend, default_backend_or_none, resolve_backend
from .chat_template import ChatTemplate, get_chat_template
from .interpreter import run_program, run_program_batch
from .ir import RUN_SAMPLING_ARGS, RunSamplingArgs, default_sampling_params
from .lint import warn_once
from .tracer import (
    TraceResult,
    batch_shared_prefix,
    placeholder_arguments,
    trace_program,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

# run_batch prefills the shared prefix once when it is at least this many characters long.
MIN_BATCH_PREFIX_CHARS = 64


class SglFunction:
    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise ValueError(f"The first argument of a DSL function must be named 's' ({func.__name__})")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = params[1:]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__
        self._lint_checked = False

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}() has no argument(s) {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> Any:
        """Runs the program once and returns its ProgramState (at once when stream=True).
        Keyword arguments named in `RunSamplingArgs` are sampling parameters; the rest go to the program."""
        sampling = {name: kwargs.pop(name) for name in RUN_SAMPLING_ARGS if name in kwargs}
        params = default_sampling_params(**sampling)
        kwargs = {**self.bind_arguments, **self._positional_to_kwargs(args), **kwargs}
        return run_program(self.func, resolve_backend(backend), (), kwargs, params, stream)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[list[Any]] | list[tuple[Any, ...]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Unpack[RunSamplingArgs],
    ) -> Any:
        """Runs the program for each kwargs dict concurrently; returns the states in order.
        `sampling`: as for run(). The prompt prefix all calls share is traced and prefilled once
        before the fan-out."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of kwargs dicts (or of positional-argument lists)")
        params = default_sampling_params(**sampling)
        if not batch_kwargs:
            return []
        batch = [{**self.bind_arguments, **self._as_kwargs(item)} for item in batch_kwargs]
        resolved = resolve_backend(backend)
        self._cache_batch_prefix(resolved, batch)
        return run_program_batch(self.func, resolved, batch, params, num_threads, progress_bar, generator_style)

    def _cache_batch_prefix(self, backend: BaseBackend, batch: list[dict[str, Any]]) -> str:
        prefix, trace = batch_shared_prefix(self.func, batch, backend.get_chat_template())
        warn_once(self, trace, self.__name__)
        if len(batch) > 1 and len(prefix) >= MIN_BATCH_PREFIX_CHARS and backend.supports_prefix_cache:
            backend.cache_prefix(prefix)
            return prefix
        return ""

    def trace(self, *, backend: Any = None, **kwargs: Any) -> TraceResult:
        """Runs the program on placeholders (arguments not given in kwargs) without a backend."""
        template = self._chat_template(backend)
        args = placeholder_arguments(self.func, {**self.bind_arguments, **kwargs})
        result = trace_program(self.func, args, template)
        warn_once(self, result, self.__name__)
        return result

    def cache(self, backend: Any = None) -> str:
        """Prefills the program's constant prompt prefix on the server; returns that prefix."""
        resolved = resolve_backend(backend)
        prefix = self.trace(backend=resolved).constant_prefix
        if prefix and resolved.supports_prefix_cache:
            resolved.cache_prefix(prefix)
        return prefix

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)

    # ---------------------------------------------------------------- helpers
    def _chat_template(self, backend: Any) -> ChatTemplate:
        resolved = resolve_backend(backend) if backend is not None else default_backend_or_none()
        return resolved.get_chat_template() if resolved is not None else get_chat_template("default")

    def _positional_to_kwargs(self, args: tuple[Any, ...]) -> dict[str, Any]:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.__name__}() takes {len(self.arg_names)} arguments, got {len(args)}")
        return dict(zip(self.arg_names, args, strict=False))

    def _as_kwargs(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            return dict(item)
        if isinstance(item, (list, tuple)):
            return self._positional_to_kwargs(tuple(item))
        raise TypeError(f"run_batch items must be dicts or argument lists, not {type(item).__name__}")

    def __repr__(self) -> str:
        return f"SglFunction({self.__name__})"
