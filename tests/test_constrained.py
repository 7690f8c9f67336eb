"""Tests for runtime/constrained (outlines-core grammar backend, jump-forward) and kernels/vocab_mask.

Random walks drive a GrammarMatcher with random allowed tokens (taken from the mask it writes) until
it accepts eos; the decoded text must then fully match the regex / validate against the schema.
"""

from __future__ import annotations

import glob
import json
import random
import re
import sysconfig
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from radixlm.kernels.vocab_mask import (
    allocate_vocab_mask,
    apply_vocab_mask,
    set_tokens_allowed,
    vocab_mask_to_bool,
)
from radixlm.runtime.constrained import (
    JSON_OBJECT_SCHEMA,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    build_vocabulary,
    token_bytes_table,
)

SOFT_STEPS = 24  # after this many random steps a walk heads for the nearest final state
MAX_STEPS = 400


# ---------------------------------------------------------------------------------------- fixtures
def _train_tokenizer(out_dir: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:40]
    texts = [open(f, "rb").read().decode("utf-8", errors="ignore") for f in files]
    texts.append('{"name": "x", "age": 3, "items": [1, 2], "ok": true, "none": null} 2024-01-31 192.168.0.1')
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(out_dir))
    return str(out_dir)


@pytest.fixture(scope="session")
def grammar_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny models' tokenizer when conftest provides it, else a locally trained byte-level BPE."""
    try:
        path = str(request.getfixturevalue("llama_path"))
    except pytest.FixtureLookupError:
        path = _train_tokenizer(tmp_path_factory.mktemp("grammar_tokenizer"))
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def vocab_size(grammar_tokenizer: Any) -> int:
    return (len(grammar_tokenizer) + 63) // 64 * 64 + 3  # padded like a model's lm_head, not a multiple of 32


@pytest.fixture(scope="session")
def backend(grammar_tokenizer: Any, vocab_size: int) -> GrammarBackend:
    be = GrammarBackend(grammar_tokenizer, vocab_size, [grammar_tokenizer.eos_token_id])
    yield be
    be.shutdown()


# ---------------------------------------------------------------------------------------- helpers
def _distances_to_final(grammar: CompiledGrammar) -> dict[int, int]:
    """Fewest tokens from each index state to a final state (reverse BFS)."""
    transitions = grammar.index.get_transitions()
    reverse: dict[int, list[int]] = {}
    for src, edges in transitions.items():
        for dst in edges.values():
            reverse.setdefault(dst, []).append(src)
    dist = {s: 0 for s in grammar.index.get_final_states()}
    queue = deque(dist)
    while queue:
        s = queue.popleft()
        for src in reverse.get(s, []):
            if src not in dist:
                dist[src] = dist[s] + 1
                queue.append(src)
    return dist


def _pick(
    matcher: GrammarMatcher, allowed: list[int], step: int, dist: dict[int, int], rng: random.Random
) -> int:
    if step < SOFT_STEPS:
        return rng.choice(allowed)
    eos = [t for t in allowed if t in matcher.grammar.eos_token_ids]
    if eos:
        return eos[0]
    state = matcher.guide.get_state()
    index = matcher.grammar.index
    return min(allowed, key=lambda t: (dist.get(index.get_next_state(state, t), 10**9), rng.random()))


def random_walk(
    grammar: CompiledGrammar, rng: random.Random, jump_forward: bool = False
) -> tuple[list[int], GrammarMatcher]:
    """Drive a fresh matcher with random allowed tokens until it accepts eos; returns the token ids."""
    matcher = grammar.new_matcher()
    dist = _distances_to_final(grammar)
    mask = allocate_vocab_mask(1, grammar.vocab_size)
    ids: list[int] = []
    promised: list[tuple[int, bytes]] = []  # (byte offset, forced text found there)
    for step in range(MAX_STEPS):
        forced = matcher.find_jump_forward()
        if forced:
            promised.append((sum(len(grammar.token_bytes[t]) for t in ids), forced.encode()))  # type: ignore[arg-type]
        if jump_forward:
            prev_text = b"".join(grammar.token_bytes[t] for t in ids).decode("utf-8", errors="replace")  # type: ignore[misc]
            tail = matcher.jump_forward_tokens(prev_text if step % 2 else None)  # None: the matcher's own
            ids.extend(tail or [])
        matcher.fill_vocab_mask(mask[0])
        allowed = torch.nonzero(vocab_mask_to_bool(mask, grammar.vocab_size)[0]).flatten().tolist()
        if step % 7 == 0:
            assert sorted(allowed) == sorted(matcher.allowed_token_ids())
        disallowed = rng.randrange(grammar.vocab_size)
        if disallowed not in allowed:
            assert not matcher.accept_token(disallowed)
        tid = _pick(matcher, allowed, step, dist, rng)
        assert matcher.accept_token(tid)
        if matcher.is_terminated():
            raw = b"".join(grammar.token_bytes[t] for t in ids)  # type: ignore[misc]
            assert all(raw[offset:].startswith(text) for offset, text in promised), (raw, promised)
            return ids, matcher
        ids.append(tid)
    raise AssertionError(f"walk did not terminate: {_decode(grammar, ids)!r}")


def _decode(grammar: CompiledGrammar, ids: list[int]) -> str:
    return b"".join(grammar.token_bytes[t] for t in ids).decode("utf-8")  # type: ignore[misc]


def _wait(backend: GrammarBackend, future: Future, timeout: float = 30.0) -> CompiledGrammar | GrammarError:
    started = time.monotonic()
    while True:
        result = backend.poll(future, started)
        if result is not None:
            return result
        assert time.monotonic() - started < timeout
        time.sleep(0.002)


# ---------------------------------------------------------------------------------------- vocabulary
def test_vocabulary_round_trip(grammar_tokenizer: Any, vocab_size: int) -> None:
    table = token_bytes_table(grammar_tokenizer, vocab_size)
    special = set(grammar_tokenizer.all_special_ids) | {
        i for i, t in grammar_tokenizer.added_tokens_decoder.items() if t.special
    }
    assert all(table[i] is None for i in special)
    assert all(b is None for b in table[len(grammar_tokenizer) :])
    checked = 0
    for tid, raw in enumerate(table):
        if raw is None:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial UTF-8 piece; covered by the encode round trip below
        assert grammar_tokenizer.decode([tid]) == text, (tid, raw)
        checked += 1
    assert checked > 0.8 * (len(grammar_tokenizer) - len(special))
    for text in ["def f(x):\n    return x + 1", 'héllo wörld 中文 {"a": [1, 2.5]}', "\t tabs  and\r\n lines"]:
        ids = grammar_tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(table[t] for t in ids) == text.encode("utf-8")
    vocab = build_vocabulary(grammar_tokenizer, vocab_size)
    assert vocab.get_eos_token_id() == grammar_tokenizer.eos_token_id
    assert vocab.get(b"{") == [grammar_tokenizer.convert_tokens_to_ids("{")]


def test_sentencepiece_style_tokens() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = {"<unk>": 0, "</s>": 1, "<0x0A>": 2, "<0xE4>": 3, "\u2581a": 4, "b": 5, "\u2581": 6}
    tok = Tokenizer(models.BPE(vocab=pieces, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    table = token_bytes_table(fast, 8)
    assert table[:8] == [None, None, b"\n", b"\xe4", b" a", b"b", b" ", None]


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
    grammar = _wait(backend, backend.request("regex", regex))
    assert isinstance(grammar, CompiledGrammar), grammar
    rng = random.Random(hash(regex) & 0xFFFF)
    for _ in range(10):
        ids, _ = random_walk(grammar, rng)
        text = _decode(grammar, ids)
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
    grammar = _wait(backend, backend.request("json_schema", json.dumps(schema)))
    assert isinstance(grammar, CompiledGrammar), grammar
    rng = random.Random(len(json.dumps(schema)))
    for _ in range(8):
        ids, _ = random_walk(grammar, rng)
        text = _decode(grammar, ids)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_random_walks(backend: GrammarBackend) -> None:
    grammar = _wait(backend, backend.request("json_schema", JSON_OBJECT_SCHEMA))
    assert isinstance(grammar, CompiledGrammar), grammar
    rng = random.Random(3)
    for _ in range(8):
        ids, _ = random_walk(grammar, rng)
        assert isinstance(json.loads(_decode(grammar, ids)), dict)


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
    result = _wait(backend, backend.request(kind, spec))
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
        error = _wait(be, slow)
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


# ---------------------------------------------------------------------------------------- matcher
def test_matcher_copy_and_eos_ids(grammar_tokenizer: Any, vocab_size: int) -> None:
    eos = grammar_tokenizer.eos_token_id
    extra_eos = (
        grammar_tokenizer.convert_tokens_to_ids("<|im_end|>")
        if "<|im_end|>" in grammar_tokenizer.get_vocab()
        else vocab_size - 1
    )
    be = GrammarBackend(grammar_tokenizer, vocab_size, [eos, extra_eos])
    try:
        grammar = be.compile("regex", "ab")
    finally:
        be.shutdown()
    a_id, b_id = (grammar_tokenizer.convert_tokens_to_ids(c) for c in "ab")
    m = grammar.new_matcher()
    assert not m.accept_token(eos) and not m.accept_token(b_id)
    assert m.accept_token(a_id)
    clone = m.copy()
    assert m.accept_token(b_id) and m.is_final()
    assert not clone.is_final() and clone.allowed_token_ids() == [b_id]
    mask = allocate_vocab_mask(1, vocab_size)
    m.fill_vocab_mask(mask[0])
    allowed = set(torch.nonzero(vocab_mask_to_bool(mask, vocab_size)[0]).flatten().tolist())
    assert allowed == {eos, extra_eos}
    bool_row = torch.ones(vocab_size, dtype=torch.bool)  # the bool-row form of fill_vocab_mask
    clone.fill_vocab_mask(bool_row)
    assert torch.nonzero(bool_row).flatten().tolist() == [b_id]
    assert m.accept_token(extra_eos) and m.is_terminated()
    assert not m.accept_token(eos)


def test_mixed_batch_masking(backend: GrammarBackend, vocab_size: int) -> None:
    digits = backend.compile("regex", "[0-9]{3}").new_matcher()
    words = backend.compile("regex", "(yes|no)").new_matcher()
    mask = allocate_vocab_mask(3, vocab_size)
    digits.fill_vocab_mask(mask[0])
    words.fill_vocab_mask(mask[2])  # row 1 stays unconstrained
    logits = torch.randn(3, vocab_size)
    before = logits.clone()
    apply_vocab_mask(logits, mask)
    assert torch.equal(logits[1], before[1])
    first = backend.token_bytes[int(logits[0].argmax())]
    assert first is not None and first.isdigit()
    assert int(logits[2].argmax()) in words.allowed_token_ids()
    assert torch.isinf(logits[0]).sum() == vocab_size - len(digits.allowed_token_ids())


# ---------------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_apply_vocab_mask_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    bs, vocab = 5, 1000  # not a multiple of 32
    allowed = torch.rand(bs, vocab, generator=gen) < 0.3
    mask = allocate_vocab_mask(bs, vocab)
    mask.zero_()
    for row in range(bs):
        set_tokens_allowed(mask[row], torch.nonzero(allowed[row]).flatten().tolist(), allowed=True)
    assert torch.equal(vocab_mask_to_bool(mask, vocab), allowed)
    logits = torch.randn(bs, vocab, generator=gen).to(dtype)
    expected = logits.masked_fill(~allowed, float("-inf"))
    apply_vocab_mask(logits, mask)
    assert torch.equal(logits, expected)


def test_set_tokens_allowed_high_bits() -> None:
    mask = allocate_vocab_mask(1, 64)
    set_tokens_allowed(mask[0], [31, 63, 0], allowed=False)
    bits = vocab_mask_to_bool(mask, 64)[0]
    assert not bits[31] and not bits[63] and not bits[0] and bool(bits[1:31].all())
    set_tokens_allowed(mask[0], [31], allowed=True)
    assert bool(vocab_mask_to_bool(mask, 64)[0][31])


# ---------------------------------------------------------------------------------------- jump-forward
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 6},
        "shipping_address_line": {"type": "string", "maxLength": 6},
        "number_of_items_ordered": {"type": "integer"},
        "is_gift_wrapped": {"type": "boolean"},
    },
    "required": ["customer_full_name", "shipping_address_line", "number_of_items_ordered", "is_gift_wrapped"],
}


def test_jump_forward_forced_text_and_tokens(backend: GrammarBackend, grammar_tokenizer: Any) -> None:
    grammar = backend.compile("json_schema", json.dumps(LONG_KEYS))
    matcher = grammar.new_matcher()
    forced = matcher.find_jump_forward()
    assert forced == '{"customer_full_name": "'
    tokens = matcher.jump_forward_tokens("")
    assert tokens == grammar_tokenizer.encode(forced, add_special_tokens=False)
    assert grammar_tokenizer.decode(tokens) == forced
    assert _decode(grammar, tokens) == forced
    assert matcher.accepted_ids == tokens and matcher.jump_forward_count == len(tokens)
    assert matcher.find_jump_forward() is None  # inside the string value: nothing forced
    assert matcher.jump_forward_tokens(forced) is None
    assert matcher.accepted_ids == tokens


@pytest.mark.parametrize(
    ("regex", "expected"),
    [
        ("(cherry pie|cherry tart|cheese)", "che"),
        (r'\{"name":[0-9]+\}', '{"name":'),
        ("(a|b)xyz", None),
        ("foo(bar)?", "foo"),
        ("(ab){2,3}", "abab"),
        ("(h\u00e9llo|h\u00e9ros)", "h\u00e9"),
    ],
)
def test_find_jump_forward_known_prefixes(backend: GrammarBackend, regex: str, expected: str | None) -> None:
    matcher = backend.compile("regex", regex).new_matcher()
    assert matcher.find_jump_forward() == expected
    if expected:
        assert matcher.jump_forward_tokens("") is not None
        assert matcher.find_jump_forward() is None


def test_jump_forward_refuses_merge_across_boundary(backend: GrammarBackend, grammar_tokenizer: Any) -> None:
    def encode(text: str) -> list[int]:
        return grammar_tokenizer.encode(text, add_special_tokens=False)

    # a word that is one token: "{prev}{rest}" tokenizes differently from "{prev}" followed by "{rest}"
    word = next(
        t
        for t in sorted(grammar_tokenizer.get_vocab())
        if t.isascii() and t.isalpha() and len(t) >= 4 and len(encode(t)) == 1
    )
    prev, rest = word[:2], word[2:]
    assert encode(prev + rest)[: len(encode(prev))] != encode(prev)
    matcher = backend.compile("regex", re.escape(rest) + "[0-9]").new_matcher()
    state = matcher.guide.get_state()
    assert matcher.find_jump_forward() == rest
    assert matcher.jump_forward_tokens(prev) is None
    assert matcher.guide.get_state() == state and matcher.accepted_ids == []
    assert matcher.jump_forward_tokens("") == encode(rest)


def test_jump_forward_walks_validate(backend: GrammarBackend) -> None:
    grammar = backend.compile("json_schema", json.dumps(LONG_KEYS))
    rng = random.Random(7)
    total_jumped = 0
    for _ in range(8):
        ids, matcher = random_walk(grammar, rng, jump_forward=True)
        assert matcher.copy().accepted_ids == ids
        assert matcher.accepted_ids == ids
        jsonschema.validate(json.loads(_decode(grammar, ids)), LONG_KEYS)
        total_jumped += matcher.jump_forward_count
    assert total_jumped > 8 * 10


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
