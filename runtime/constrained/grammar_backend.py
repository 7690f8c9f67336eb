"""Grammar backend (scheduler side): compile constraints off the scheduler thread, with an LRU cache.

Flow for one request: the scheduler calls `request(kind, spec)` and gets a Future; the request waits in
the grammar queue while `poll(future, started_at)` returns None; then it gets `new_matcher()` of the
compiled grammar (an outlines-core `CompiledGrammar` or an `XGrammarCompiled`), or a `GrammarError`
that fails only that request (a 400 with the message).

- Size first: a constraint over `max_constraint_bytes` is refused before any work.
- Compilation runs in worker processes (`CompilePool`): each compile has a deadline
  (`compile_timeout`) after which its worker is killed and replaced, and a memory limit. The pool
  thread turns the worker's payload back into an Index / CompiledGrammar. `num_workers=0` compiles
  in threads of this process instead (no deadline enforcement; for tests and offline tools).
- Which engine compiles what: see `engines.engine_for` (`--grammar-backend`).
- Results and errors (timeouts included) are cached LRU by (kind, spec), `max_cache` entries, so a
  constraint that timed out is refused at once the next time.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import outlines_core

from .compile_pool import LOAD_DEADLINE_S, CompilePool
from .engines import CompileResult, EngineSet, VocabSpec, engine_for
from .grammar_matcher import GrammarMatcher
from .jump_forward import ForcedTextFinder
from .regex_rules import (
    JSON_OBJECT_SCHEMA,
    GrammarError,
    any_json_object_regex,
    schema_to_regex,
)
from .vocabulary import token_bytes_table
from .xgrammar_matcher import XGrammarCompiled

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
__all__ = ["JSON_OBJECT_SCHEMA", "CompiledGrammar", "GrammarBackend", "GrammarError", "any_json_object_regex",
           "check_supported", "schema_to_regex"]


@dataclass
class CompiledGrammar:
    """One compiled outlines-core constraint, shared read-only by every request that uses it."""

    kind: str
    spec: str
    regex: str
    index: outlines_core.Index = field(repr=False)
    tokenizer: Any = field(repr=False)
    token_bytes: list[bytes | None] = field(repr=False)
    vocab_size: int
    eos_token_ids: frozenset[int]
    vocab_eos_id: int  # the eos outlines-core knows; GrammarMatcher maps it to all eos_token_ids
    compile_time_s: float
    forced_text: ForcedTextFinder = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.forced_text = ForcedTextFinder(self.index, self.token_bytes)

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (one per request)."""
        return GrammarMatcher(self)


def check_supported(kind: str, backend: str = "outlines") -> None:
    """Raise GrammarError for constraint kinds no engine here handles (cheap; usable before queuing)."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"Unknown constraint kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
    engine_for(backend, kind)


class GrammarBackend:
    """Compiles constraints in worker processes, with an LRU cache; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        whitespace_pattern: str | None = None,
        compile_timeout: float = 30.0,
        max_cache: int = 256,
        backend: str = "outlines",
        max_constraint_bytes: int = 64 * 1024,
        memory_limit_mb: int = 2048,
        num_workers: int = 2,
        max_workers: int = 4,
    ) -> None:
        eos = [int(t) for t in eos_token_ids] or [int(tokenizer.eos_token_id)]
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self.whitespace_pattern = whitespace_pattern
        self.compile_timeout = compile_timeout
        self.max_cache = max_cache
        self.backend = backend
        self.max_constraint_bytes = max_constraint_bytes
        self.token_bytes = token_bytes_table(tokenizer, vocab_size)
        for tid in self.eos_token_ids:
            if tid < vocab_size:
                self.token_bytes[tid] = None
        self.vocab_eos_id = eos[0]
        self.vocab_spec = VocabSpec(self.token_bytes, vocab_size, sorted(self.eos_token_ids), self.vocab_eos_id)
        self.cache_hits = 0
        self.cache_misses = 0
        self._xgr_info: Any = None
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: CompilePool | None = None
        self._threads: ThreadPoolExecutor | None = None
        if num_workers > 0:
            preload = ("xgrammar",) if backend == "xgrammar" else ("outlines",)
            self._pool = CompilePool(self.vocab_spec, whitespace_pattern, compile_timeout, memory_limit_mb,
                                     min_workers=num_workers, max_workers=max_workers, preload=preload)
        else:
            self._engines = EngineSet(self.vocab_spec, whitespace_pattern)
            self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    # ------------------------------------------------------------------ requests
    def request(self, kind: str, spec: str) -> Future[Any]:
        """A future for the compiled constraint. Never blocks and never raises.

        The future resolves to a compiled grammar (with `new_matcher()`), or raises GrammarError
        ("Invalid regex: ...", too large, unknown kind, compile timed out / over the memory limit).
        """
        key = (kind, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return future
            self.cache_misses += 1
            future = self._start(kind, spec)
            self._cache[key] = future
            while len(self._cache) > self.max_cache:
                self._cache.popitem(last=False)
            return future

    def poll(self, future: Future[Any], started_at: float) -> Any:
        """The grammar, its error, or None while still compiling (started_at: time.monotonic()).

        The pool enforces the deadline per compile; this only guards against a wait far beyond it
        (a compile queued behind `max_workers` slow ones)."""
        if future.done():
            error = future.exception()
            if error is None:
                return future.result()
            return error if isinstance(error, GrammarError) else GrammarError(f"Grammar compilation failed: {error}")
        limit = 4 * self.compile_timeout + LOAD_DEADLINE_S
        if time.monotonic() - started_at > limit:
            return GrammarError(f"Grammar compile did not finish within {limit:g} s "
                                "(the compile workers are busy); retry later")
        return None

    def compile(self, kind: str, spec: str) -> Any:
        """Blocking compile through the cache (for tests and offline tools); raises GrammarError."""
        return self.request(kind, spec).result()

    def shutdown(self) -> None:
        """Stop the workers (processes are killed; threads finish their compile first)."""
        if self._pool is not None:
            self._pool.shutdown()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _start(self, kind: str, spec: str) -> Future[Any]:
        try:
            size = len(spec.encode("utf-8", "surrogatepass"))
            if size > self.max_constraint_bytes:
                raise GrammarError(f"The {kind} constraint is {size} bytes, over the limit of "
                                   f"{self.max_constraint_bytes} (--max-constraint-bytes)")
            check_supported(kind, self.backend)
            engine = engine_for(self.backend, kind)
        except GrammarError as e:
            return _failed(e)
        if self._pool is not None:
            raw = self._pool.submit(engine, kind, spec)
        else:
            raw = self._threads.submit(self._engines.compile, engine, kind, spec)  # type: ignore[union-attr]
        out: Future[Any] = Future()
        raw.add_done_callback(lambda f: self._finish(f, out))
        return out

    def _finish(self, raw: Future[CompileResult], out: Future[Any]) -> None:
        """Runs in the pool thread: rebuild the engine object from the worker's payload."""
        try:
            out.set_result(self._load(raw.result()))
        except GrammarError as e:
            out.set_exception(e)
        except Exception as e:  # noqa: BLE001 - a broken payload fails only this constraint
            out.set_exception(GrammarError(f"Grammar compilation failed: {type(e).__name__}: {e}"))

    def _load(self, res: CompileResult) -> Any:
        common = dict(kind=res.kind, spec=res.spec, tokenizer=self.tokenizer, token_bytes=self.token_bytes,
                      vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
                      compile_time_s=res.compile_time_s)
        if res.engine == "outlines":
            index = pickle.loads(res.payload)  # noqa: S301 - our own worker's output
            return CompiledGrammar(regex=res.regex or "", index=index, vocab_eos_id=self.vocab_eos_id, **common)
        import xgrammar as xgr

        if self._xgr_info is None:
            from .engines import xgrammar_tokenizer_info

            self._xgr_info = xgrammar_tokenizer_info(self.vocab_spec)
        return XGrammarCompiled(compiled=xgr.CompiledGrammar.deserialize_json(res.payload, self._xgr_info),
                                **common)


def _failed(error: Exception) -> Future[CompiledGrammar]:
    future: Future[CompiledGrammar] = Future()
    future.set_exception(error)
    return future
