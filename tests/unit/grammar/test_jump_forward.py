"""runtime/constrained/jump_forward.py: forced text found in the grammar, and the tokens jumped."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
from grammar_walks import decode_ids, random_walk

from radixlm.runtime.constrained import GrammarBackend

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
    assert decode_ids(grammar, tokens) == forced
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
        jsonschema.validate(json.loads(decode_ids(grammar, ids)), LONG_KEYS)
        total_jumped += matcher.jump_forward_count
    assert total_jumped > 8 * 10
