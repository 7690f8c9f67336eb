"""Constrained decoding: regex / JSON-schema / EBNF / structural-tag grammars, vocab masks, jump-forward.

Entry point: `GrammarBackend` (compile in killable worker processes + cache), `new_matcher()` of a
compiled grammar per request, and `radixlm.kernels.vocab_mask` to apply the masks a matcher writes.
Engines (`engines.GRAMMAR_ENGINES`): outlines-core (regex, JSON schema) and xgrammar (those plus
EBNF and structural tags). Names are loaded lazily so that the compile workers import no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DEFAULT_JSON_WHITESPACE_PATTERN": "regex_rules",
    "JSON_OBJECT_SCHEMA": "regex_rules",
    "GrammarError": "regex_rules",
    "normalize_regex": "regex_rules",
    "schema_to_regex": "regex_rules",
    "GRAMMAR_ENGINES": "engines",
    "CompiledGrammar": "grammar_backend",
    "GrammarBackend": "grammar_backend",
    "check_supported": "grammar_backend",
    "GrammarMatcher": "grammar_matcher",
    "XGrammarMatcher": "xgrammar_matcher",
    "build_vocabulary": "vocabulary",
    "token_bytes_table": "vocabulary",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
