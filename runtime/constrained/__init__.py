"""Constrained decoding: regex / JSON-schema grammars on outlines-core, vocab masks, jump-forward.

Entry point: `GrammarBackend` (compile + cache), `CompiledGrammar.new_matcher()` per request, and
`radixlm.kernels.vocab_mask` to apply the masks a `GrammarMatcher` writes.
"""

from __future__ import annotations

from radixlm.runtime.constrained.grammar_backend import (
    DEFAULT_JSON_WHITESPACE_PATTERN,
    JSON_OBJECT_SCHEMA,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    check_supported,
    schema_to_regex,
)
from radixlm.runtime.constrained.grammar_matcher import GrammarMatcher
from radixlm.runtime.constrained.vocabulary import build_vocabulary, token_bytes_table

# name -> backend class (only outlines-core today)
GRAMMAR_BACKENDS: dict[str, type[GrammarBackend]] = {"outlines": GrammarBackend}

__all__ = [
    "DEFAULT_JSON_WHITESPACE_PATTERN",
    "GRAMMAR_BACKENDS",
    "JSON_OBJECT_SCHEMA",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "build_vocabulary",
    "check_supported",
    "schema_to_regex",
    "token_bytes_table",
]
