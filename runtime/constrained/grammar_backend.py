"""Grammar backend on outlines-core: compile regex / JSON-schema constraints off the scheduler thread.

Flow for one request: the scheduler calls `request(kind, spec)` and gets a Future; the request waits in
the grammar queue while `poll(future, started_at)` returns None; then it gets
`CompiledGrammar.new_matcher()` (its own Guide over the shared Index), or a `GrammarError` that fails
only that request (a 400 with the message).

- Compilation (JSON schema -> regex, then `outlines_core.Index`) runs in a ThreadPoolExecutor; the
  Index build releases the GIL, so the scheduler loop keeps running.
- Results (and errors) are cached LRU by (kind, spec), `max_cache` entries.
- Compile time is bounded by `compile_timeout`: `poll` turns an expired wait into a GrammarError. The
  worker thread cannot be interrupted; its result is still cached when it finishes.

JSON whitespace. The default `whitespace_pattern` is "" (compact JSON: `{"a":1,"b":[2,3]}`). Output
stays valid JSON, and since no optional whitespace may follow `{`, `,` or `:`, every key of a schema
with fixed properties is forced text, which jump-forward appends without decode steps. Pass e.g.
`"[ ]?"` (outlines' own default) to let the model place single spaces.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import outlines_core
from outlines_core.json_schema import build_regex_from_schema

from radixlm.runtime.constrained.grammar_matcher import GrammarMatcher
from radixlm.runtime.constrained.jump_forward import ForcedTextFinder
from radixlm.runtime.constrained.vocabulary import token_bytes_table, vocabulary_from_table

DEFAULT_JSON_WHITESPACE_PATTERN = ""
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")
# response_format {"type": "json_object"}: any JSON object, see `any_json_object_regex`
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_JSON_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"


class GrammarError(ValueError):
    """A constraint that cannot be used; the message is meant for the client (HTTP 400)."""


@dataclass
class CompiledGrammar:
    """One compiled constraint, shared read-only by every request that uses it."""

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


def check_supported(kind: str) -> None:
    """Raise GrammarError for constraint kinds this backend refuses (cheap; usable before queuing)."""
    if kind == "ebnf":
        raise GrammarError("ebnf constraints are not supported; use regex or json_schema")
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"Unknown constraint kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")


def any_json_object_regex(whitespace_pattern: str, depth: int = 1) -> str:
    """A JSON object whose values nest at most `depth` more arrays/objects deep.

    outlines-core's regex for a property-less `{"type": "object"}` nests three levels and takes ~5 s
    to index with a 32k vocab; depth 1 (values: scalars, flat arrays, flat objects) takes ~0.3 s.
    """
    ws = f"({whitespace_pattern})" if whitespace_pattern else ""
    scalar = f"({_JSON_STRING}|{_JSON_NUMBER}|true|false|null)"

    def value(level: int) -> str:
        return scalar if level == 0 else f"({scalar}|{array(level - 1)}|{obj(level - 1)})"

    def array(level: int) -> str:
        item = value(level)
        return rf"\[{ws}({item}({ws},{ws}{item})*)?{ws}\]"

    def obj(level: int) -> str:
        member = f"{_JSON_STRING}{ws}:{ws}{value(level)}"
        return rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"

    return obj(depth)


def schema_to_regex(spec: str, whitespace_pattern: str | None) -> str:
    """The regex of a JSON schema given as a JSON string; GrammarError if it is invalid."""
    try:
        parsed = json.loads(spec)
    except (TypeError, json.JSONDecodeError) as e:
        raise GrammarError(f"Invalid JSON schema: not valid JSON ({e})") from None
    if not isinstance(parsed, (dict, bool)):
        raise GrammarError("Invalid JSON schema: a schema must be a JSON object")
    if parsed == {"type": "object"}:
        return any_json_object_regex(whitespace_pattern or "")
    try:
        return build_regex_from_schema(spec, whitespace_pattern=whitespace_pattern)
    except Exception as e:  # outlines-core raises ValueError / TypeError with multi-line messages
        raise GrammarError(f"Invalid JSON schema: {_one_line(e)}") from None


def _regex_error(regex: str, error: Exception) -> GrammarError:
    try:
        re.compile(regex)
    except re.error as py_error:
        return GrammarError(f"Invalid regex: {py_error}")
    message = _one_line(error)
    if "NFA" in message or "DFA" in message:
        return GrammarError(f"Invalid regex: {message} (Rust regex syntax: no lookaround or backreferences)")
    return GrammarError(f"Invalid regex: {message}")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


class GrammarBackend:
    """Compiles constraints in a thread pool, with an LRU cache; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        whitespace_pattern: str | None = None,
        compile_timeout: float = 30.0,
        max_cache: int = 256,
        num_threads: int = 2,
    ) -> None:
        eos = [int(t) for t in eos_token_ids] or [int(tokenizer.eos_token_id)]
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self.whitespace_pattern = (
            DEFAULT_JSON_WHITESPACE_PATTERN if whitespace_pattern is None else whitespace_pattern
        )
        self.compile_timeout = compile_timeout
        self.max_cache = max_cache
        self.token_bytes = token_bytes_table(tokenizer, vocab_size)
        for tid in self.eos_token_ids:
            if tid < vocab_size:
                self.token_bytes[tid] = None
        self.vocab_eos_id = eos[0]
        self.vocabulary = vocabulary_from_table(self.token_bytes, self.vocab_eos_id)
        self.cache_hits = 0
        self.cache_misses = 0
        self._cache: OrderedDict[tuple[str, str], tuple[Future[CompiledGrammar], float]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")

    # ------------------------------------------------------------------ requests
    def request(self, kind: str, spec: str) -> Future[CompiledGrammar]:
        """A future for the compiled constraint. Never blocks and never raises.

        The future resolves to a CompiledGrammar, or raises GrammarError ("Invalid regex: ...",
        "Invalid JSON schema: ...", ebnf / unknown kinds refused, compile timed out).
        """
        key = (kind, spec)
        now = time.monotonic()
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                future, submitted_at = entry
                if not future.done() and now - submitted_at > self.compile_timeout:
                    return _failed(self._timeout_error())  # a slow compile of this spec is still running
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return future
            self.cache_misses += 1
            try:
                check_supported(kind)
            except GrammarError as e:
                future = _failed(e)
            else:
                future = self._pool.submit(self._compile, kind, spec)
            self._cache[key] = (future, now)
            self._evict()
            return future

    def poll(
        self, future: Future[CompiledGrammar], started_at: float
    ) -> CompiledGrammar | GrammarError | None:
        """The grammar, its error, or None while still compiling (started_at: time.monotonic())."""
        if future.cancelled():
            return GrammarError("Grammar compilation was cancelled (the server is shutting down)")
        if future.done():
            error = future.exception()
            if error is None:
                return future.result()
            if isinstance(error, GrammarError):
                return error
            return GrammarError(f"Grammar compilation failed: {error}")
        if time.monotonic() - started_at > self.compile_timeout:
            return self._timeout_error()
        return None

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """Blocking compile through the cache (for tests and offline tools); raises GrammarError."""
        return self.request(kind, spec).result()

    def shutdown(self) -> None:
        """Stop the worker threads (running compiles finish first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _timeout_error(self) -> GrammarError:
        return GrammarError(
            f"Grammar compile timed out after {self.compile_timeout:g} s; simplify the constraint"
        )

    def _evict(self) -> None:
        while len(self._cache) > self.max_cache:
            self._cache.popitem(last=False)

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        start = time.perf_counter()
        regex = spec if kind == "regex" else schema_to_regex(spec, self.whitespace_pattern)
        try:
            index = outlines_core.Index(regex, self.vocabulary)
        except Exception as e:
            if kind == "regex":
                raise _regex_error(regex, e) from None
            raise GrammarError(f"Invalid JSON schema: it cannot be compiled ({_one_line(e)})") from None
        return CompiledGrammar(
            kind=kind,
            spec=spec,
            regex=regex,
            index=index,
            tokenizer=self.tokenizer,
            token_bytes=self.token_bytes,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            vocab_eos_id=self.vocab_eos_id,
            compile_time_s=time.perf_counter() - start,
        )


def _failed(error: Exception) -> Future[CompiledGrammar]:
    future: Future[CompiledGrammar] = Future()
    future.set_exception(error)
    return future
