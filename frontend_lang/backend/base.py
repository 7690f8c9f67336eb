"""The interface every DSL backend implements, the server-error exception, and the default backend.

The interpreter hands a backend the program's prompt state (a `PromptState`: the text so far,
the finished messages and the open role) and gets back text plus a meta-info dict. Backends are
called from many threads at once (one worker per program state), so they must be thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from ..chat_template import ChatTemplate, get_chat_template
from ..choices import ChoicesDecision, ChoicesSamplingMethod
from ..ir import SglSamplingParams


class BackendError(RuntimeError):
    """A server answered with an error; `message` is the server's own text."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(f"[{status_code}] {message}" if status_code is not None else message)
        self.message = message
        self.status_code = status_code


class PromptState(Protocol):
    """What a backend may read from a program state."""

    text_: str
    messages_: list[dict[str, Any]]
    cur_role: str | None
    cur_role_begin_pos: int
    session_: Any   # the backend's per-state session cursor (new_session_cursor), or None


class BaseBackend:
    """Defaults: no prefix caching, no select, the `default` chat template."""

    chat_template: ChatTemplate = get_chat_template("default")
    supports_prefix_cache: bool = False

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_name(self) -> str:
        raise NotImplementedError

    def cache_prefix(self, prefix_str: str) -> None:
        """Computes and caches the KV of `prefix_str` without generating (no-op without a cache)."""

    def new_session_cursor(self) -> Any:
        """A program's handle on a server session (RuntimeEndpoint); None: the backend has none."""
        return None

    def cache_fork_prefix(self, s: PromptState) -> None:
        """Before `s` forks: computes and caches the prefix the branches share."""
        if self.supports_prefix_cache:
            self.cache_prefix(s.text_)

    def generate(self, s: PromptState, sampling_params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def generate_stream(self, s: PromptState, sampling_params: SglSamplingParams
                        ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yields (new text, meta info so far) pieces; the default streams one piece."""
        yield self.generate(s, sampling_params)

    def select(self, s: PromptState, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise NotImplementedError(f"{type(self).__name__} does not support select")

    def flush_cache(self) -> None:
        raise NotImplementedError

    def get_server_info(self) -> dict[str, Any]:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Releases connections (and, for Runtime, the server)."""


_default_backend: BaseBackend | None = None


def set_default_backend(backend: Any) -> None:
    """The backend `run`, `run_batch` and `trace` use when none is passed (a Runtime is accepted)."""
    global _default_backend
    _default_backend = backend


def resolve_backend(backend: Any | None) -> BaseBackend:
    """`backend` or the default one; a `Runtime` resolves to its `RuntimeEndpoint`."""
    backend = backend if backend is not None else _default_backend
    if backend is None:
        raise ValueError("No backend: pass backend=... or call radixlm.set_default_backend(...) first")
    endpoint = getattr(backend, "endpoint", None)
    if endpoint is not None:
        backend = endpoint
    if not isinstance(backend, BaseBackend):
        raise TypeError(f"Not a DSL backend: {type(backend).__name__}")
    return backend


def default_backend_or_none() -> BaseBackend | None:
    return resolve_backend(None) if _default_backend is not None else None
