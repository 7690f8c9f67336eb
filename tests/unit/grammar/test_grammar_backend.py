"""runtime/constrained/grammar_backend.py: regexes and JSON schemas compile to grammars whose random
walks always match; invalid constraints, compile timeouts and the LRU cache."""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import Future
from typing import Any

import jsonschema
import pytest
from grammar_walks import decode_ids, random_walk, wait_compiled

from radixlm.runtime.constrained import JSON_OBJECT_SCHEMA, CompiledGrammar, GrammarBackend, GrammarError

# ---------------------------------------------------------------------------------------- regexes
REGEXES = [
    r"-?(0|[1-9][0-9]{0,8})",  # integer
    r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",  # IPv4
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",  # date
    r"(apple|banana|cherry pie|durian)",  # enum of words
    r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",  # phone number
    r"((ab|cd)+x){2,3}(y|z)?",  # nested groups with quantifiers
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)",  # email-like
    r"-?[0-9]+\.[0-9]{1,3}",  # decimal
    r"(h\u00e9llo|\u4e2d\u6587)( (h\u00e9llo|\u4e2d\u6587)){0,2}",  # multi-byte characters
    r"([01][0-9]|2[0-3]):[0-5][0-9]",  # time
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_random_walks(backend: GrammarBackend, grammar_tokenizer: Any, regex: str) -> None:
    grammar = wait_compiled(backend, backend.request("regex", regex))
    assert isinstance(grammar, CompiledGrammar), grammar
    rng = random.Random(hash(regex) & 0xFFFF)
    for _ in range(10):
        ids, _ = random_walk(grammar, rng)
        text = decode_ids(grammar, ids)
        assert re.fullmatch(regex, text), (regex, text)
        assert grammar_tokenizer.decode(ids) == text


# ---------------------------------------------------------------------------------------- JSON schemas
SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "id": {"type": "integer"}},
                "required": ["name", "id"],
            },
            "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        },
        "required": ["user", "meta"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},  # array bounds
    {  # enums
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M"]},
        },
        "required": ["color", "size"],
    },
    {  # primitives
        "type": "object",
        "properties": {
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
            "n": {"type": "null"},
        },
        "required": ["i", "x", "b", "n"],
    },
    {  # required and optional fields
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "string", "maxLength": 5},
            "c": {"type": "boolean"},
        },
        "required": ["b"],
    },
    {  # string length bounds
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["code"],
    },
    {  # array of objects
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "number"}},
            "required": ["k", "v"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # nested arrays and enum of mixed types
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            },
            "mode": {"enum": ["on", 3, None]},
        },
        "required": ["grid", "mode"],
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_random_walks(backend: GrammarBackend, schema: dict[str, Any]) -> None:
    grammar = wait_compiled(backend, backend.request("json_schema", json.dumps(schema)))
    assert isinstance(grammar, CompiledGrammar), grammar
    rng = random.Random(len(json.dumps(schema)))
    for _ in range(8):
        ids, _ = random_walk(grammar, rng)
        text = decode_ids(grammar, ids)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_random_walks(backend: GrammarBackend) -> None:
    grammar = wait_compiled(backend, backend.request("json_schema", JSON_OBJECT_SCHEMA))
    assert isinstance(grammar, CompiledGrammar), grammar
    rng = random.Random(3)
    for _ in range(8):
        ids, _ = random_walk(grammar, rng)
        assert isinstance(json.loads(decode_ids(grammar, ids)), dict)


# ---------------------------------------------------------------------------------------- errors, cache
@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("regex", "(ab", "Invalid regex: missing )"),
        ("regex", "(?<=a)b", "Invalid regex:"),
        ("json_schema", "{not json", "Invalid JSON schema: not valid JSON"),
        ("json_schema", '{"type": "strange"}', "Invalid JSON schema: Unsupported type: strange"),
        ("json_schema", "[1, 2]", "Invalid JSON schema"),
        ("ebnf", "root ::= undefined_rule", "Invalid ebnf"),
        ("structural_tag", "[]", "Invalid structural_tag"),
        ("regex", "a" * 70000, "The regex constraint is 70000 bytes, over the limit"),
    ],
)
def test_invalid_constraints(backend: GrammarBackend, kind: str, spec: str, message: str) -> None:
    result = wait_compiled(backend, backend.request(kind, spec))
    assert isinstance(result, GrammarError)
    assert isinstance(result, ValueError)
    assert str(result).startswith(message), str(result)
    with pytest.raises(GrammarError):
        backend.compile(kind, spec)


def test_poll_guards_a_wait_far_past_the_deadline(backend: GrammarBackend) -> None:
    pending: Future = Future()
    assert backend.poll(pending, time.monotonic()) is None
    error = backend.poll(pending, time.monotonic() - 4 * backend.compile_timeout - 1000)
    assert isinstance(error, GrammarError) and "did not finish" in str(error)


def test_slow_compile_is_killed_and_others_go_on(grammar_tokenizer: Any, vocab_size: int) -> None:
    """A pathological regex gets a timeout error from its killed worker; a normal one compiles
    meanwhile; the failure is cached; the pool replaces the killed worker."""
    be = GrammarBackend(grammar_tokenizer, vocab_size, [grammar_tokenizer.eos_token_id], compile_timeout=1.0)
    try:
        started = time.monotonic()
        slow = be.request("regex", "(.*a.{20}b)")
        fast = be.compile("regex", "[0-9]+")
        assert isinstance(fast, CompiledGrammar)
        error = wait_compiled(be, slow)
        assert isinstance(error, GrammarError) and "timed out after 1 s" in str(error), error
        assert time.monotonic() - started < 30
        assert be.request("regex", "(.*a.{20}b)") is slow  # cached: refused at once next time
        assert be._pool.workers_killed == 1
        assert isinstance(be.compile("regex", "[a-z]+"), CompiledGrammar)
    finally:
        be.shutdown()


def test_lru_cache(grammar_tokenizer: Any, vocab_size: int) -> None:
    be = GrammarBackend(grammar_tokenizer, vocab_size, [grammar_tokenizer.eos_token_id], max_cache=2)
    try:
        first = be.request("regex", "a+")
        assert be.request("regex", "a+") is first
        assert (be.cache_hits, be.cache_misses) == (1, 1)
        assert be.compile("regex", "a+") is first.result()
        be.request("regex", "b+")
        be.request("regex", "a+")  # refreshes a+, so b+ is now the oldest
        be.request("json_schema", '{"type": "integer"}')
        assert be.request("regex", "a+") is first
        misses = be.cache_misses
        be.request("regex", "b+")
        assert be.cache_misses == misses + 1  # b+ was evicted
    finally:
        be.shutdown()


def test_index_compile_time_five_fields(backend: GrammarBackend, vocab_size: int) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "email": {"type": "string"},
            "married": {"type": "boolean"},
            "score": {"type": "number"},
        },
        "required": ["name", "age", "email", "married", "score"],
    }
    grammar = backend.compile("json_schema", json.dumps(schema))
    print(f"\nIndex compile for a 5-field schema, vocab {vocab_size}: {grammar.compile_time_s * 1e3:.1f} ms")
    assert isinstance(grammar, CompiledGrammar)
