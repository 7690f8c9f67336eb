"""Grammar engines: turn one constraint into a compact, picklable compiled form.

This module runs inside the compile worker processes (see `compile_pool.py`), so it imports only the
engine libraries, never torch or the runtime. One `EngineSet` per worker holds each engine's
vocabulary, built on first use.

    engine      kinds                                   payload (what crosses the pipe)
    outlines    regex, json_schema                      pickle of the outlines-core Index (~1 MB at 49k)
    xgrammar    regex, json_schema, ebnf, structural_tag  CompiledGrammar.serialize_json() (~0.1 MB)

`GRAMMAR_ENGINES` is the registry; `engine_for(server_backend, kind)` picks one: the server's
`--grammar-backend` when it handles the kind, else xgrammar (EBNF and structural tags exist only there).
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .regex_rules import (
    GrammarError,
    normalize_regex,
    one_line,
    schema_to_regex,
)


@dataclass
class CompileResult:
    engine: str
    kind: str
    spec: str
    regex: str | None          # the regex compiled (outlines), None for xgrammar
    payload: bytes | str
    compile_time_s: float


@dataclass
class VocabSpec:
    """What a worker needs to build vocabularies: raw bytes per token id (None: never allowed)."""

    token_bytes: list[bytes | None]
    vocab_size: int
    eos_token_ids: list[int]
    vocab_eos_id: int


class EngineSet:
    """The engines of one process, each with its vocabulary built lazily."""

    def __init__(self, vocab: VocabSpec, whitespace_pattern: str | None) -> None:
        self.vocab = vocab
        self.whitespace_pattern = whitespace_pattern
        self._outlines_vocab: Any = None
        self._xgr_compiler: Any = None

    def compile(self, engine: str, kind: str, spec: str) -> CompileResult:
        start = time.perf_counter()
        regex, payload = GRAMMAR_ENGINES[engine](self, kind, spec)
        return CompileResult(engine, kind, spec, regex, payload, time.perf_counter() - start)

    # ------------------------------------------------------------ outlines-core
    def outlines_vocabulary(self) -> Any:
        if self._outlines_vocab is None:
            from .vocabulary import vocabulary_from_table

            self._outlines_vocab = vocabulary_from_table(self.vocab.token_bytes, self.vocab.vocab_eos_id)
        return self._outlines_vocab

    # ------------------------------------------------------------ xgrammar
    def xgrammar_compiler(self) -> Any:
        if self._xgr_compiler is None:
            import xgrammar as xgr

            info = xgrammar_tokenizer_info(self.vocab)
            self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._xgr_compiler


def xgrammar_tokenizer_info(vocab: VocabSpec) -> Any:
    """xgrammar's TokenizerInfo over raw token bytes; empty entries are special (never allowed)."""
    import xgrammar as xgr

    encoded = [b if b is not None else b"" for b in vocab.token_bytes]
    return xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                             stop_token_ids=sorted(vocab.eos_token_ids))


def _compile_outlines(engines: EngineSet, kind: str, spec: str) -> tuple[str, bytes]:
    import outlines_core

    if kind == "regex":
        regex = normalize_regex(spec)
    elif kind == "json_schema":
        regex = schema_to_regex(spec, engines.whitespace_pattern)
    else:
        raise GrammarError(f"{kind} constraints need --grammar-backend xgrammar")
    try:
        index = outlines_core.Index(regex, engines.outlines_vocabulary())
    except Exception as e:  # noqa: BLE001 - outlines-core raises several types with long messages
        raise regex_error(regex, e) if kind == "regex" else GrammarError(
            f"Invalid JSON schema: it cannot be compiled ({one_line(e)})") from None
    return regex, pickle.dumps(index)


def _compile_xgrammar(engines: EngineSet, kind: str, spec: str) -> tuple[None, str]:
    compiler = engines.xgrammar_compiler()
    try:
        if kind == "regex":
            compiled = compiler.compile_regex(normalize_regex(spec))
        elif kind == "json_schema":
            compiled = _xgrammar_json(compiler, spec, engines.whitespace_pattern)
        elif kind == "ebnf":
            compiled = compiler.compile_grammar(spec)
        elif kind == "structural_tag":
            compiled = _xgrammar_structural_tag(compiler, spec)
        else:
            raise GrammarError(f"Unknown constraint kind {kind!r}")
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError subclasses
        raise GrammarError(f"Invalid {kind}: {one_line(e)}") from None
    return None, compiled.serialize_json()


def _xgrammar_json(compiler: Any, spec: str, whitespace_pattern: str | None) -> Any:
    try:
        json.loads(spec)
    except (TypeError, json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"Invalid JSON schema: not valid JSON ({e})") from None
    if whitespace_pattern is None:
        return compiler.compile_json_schema(spec, any_whitespace=False, separators=(", ", ": "))
    return compiler.compile_json_schema(spec, any_whitespace=True)


def _xgrammar_structural_tag(compiler: Any, spec: str) -> Any:
    """SGLang's two formats: {"structures": [{begin, schema, end}], "triggers"} or {"format": ...}."""
    import xgrammar as xgr

    try:
        tag = json.loads(spec)
    except (TypeError, json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"Invalid structural_tag: not valid JSON ({e})") from None
    if not isinstance(tag, dict):
        raise GrammarError("Invalid structural_tag: it must be a JSON object")
    if tag.get("structures") is not None:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, list(tag.get("triggers") or []))
    if tag.get("format") is None:
        raise GrammarError("Invalid structural_tag: it needs 'structures' and 'triggers', or 'format'")
    return compiler.compile_structural_tag(spec)


def regex_error(regex: str, error: Exception) -> GrammarError:
    import re

    try:
        re.compile(regex)
    except (re.error, RecursionError, OverflowError) as py_error:
        return GrammarError(f"Invalid regex: {py_error}")
    message = one_line(error)
    if "NFA" in message or "DFA" in message:
        return GrammarError(f"Invalid regex: {message} (Rust regex syntax: no lookaround or backreferences)")
    return GrammarError(f"Invalid regex: {message}")


GRAMMAR_ENGINES: dict[str, Callable[[EngineSet, str, str], tuple[Any, Any]]] = {
    "outlines": _compile_outlines,
    "xgrammar": _compile_xgrammar,
}
ENGINE_KINDS = {"outlines": ("regex", "json_schema"),
                "xgrammar": ("regex", "json_schema", "ebnf", "structural_tag")}


def engine_for(server_backend: str, kind: str) -> str:
    """The engine that compiles `kind` under `--grammar-backend server_backend`."""
    if server_backend == "none":
        raise GrammarError("Constrained generation is disabled on this server (--grammar-backend none)")
    if server_backend not in GRAMMAR_ENGINES:
        raise GrammarError(f"Unknown grammar backend {server_backend!r}")
    if kind not in ENGINE_KINDS["xgrammar"]:
        raise GrammarError(f"Unknown constraint kind {kind!r}")
    return server_backend if kind in ENGINE_KINDS[server_backend] else "xgrammar"
