"""runtime/constrained/grammar_matcher.py: matcher state, copies, eos ids, and masks in a mixed batch."""

from __future__ import annotations

from typing import Any

import torch

from radixlm.kernels.vocab_mask import allocate_vocab_mask, apply_vocab_mask, vocab_mask_to_bool
from radixlm.runtime.constrained import GrammarBackend


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


def test_xgrammar_matcher_masks_and_jump_forward(grammar_tokenizer: Any, vocab_size: int) -> None:
    """EBNF on xgrammar (compiled in-process): forced text is jumped, masks allow only grammar tokens,
    eos only at the end."""
    import re

    from radixlm.runtime.constrained import XGrammarMatcher

    eos = grammar_tokenizer.eos_token_id
    be = GrammarBackend(grammar_tokenizer, vocab_size, [eos], num_workers=0)
    try:
        grammar = be.compile("ebnf", 'root ::= "hello world " [0-9] [0-9]')
    finally:
        be.shutdown()
    m = grammar.new_matcher()
    assert isinstance(m, XGrammarMatcher)
    forced = m.jump_forward_tokens("")
    assert forced and grammar_tokenizer.decode(forced) == "hello world "
    for _ in range(2):
        allowed = m.allowed_token_ids()
        assert allowed and eos not in allowed
        assert all(re.fullmatch(r"[0-9]{1,2}", grammar_tokenizer.decode([t])) for t in allowed)
        digit = next(t for t in allowed if len(grammar_tokenizer.decode([t])) == 1)
        assert m.accept_token(digit)
    assert m.is_final() and m.allowed_token_ids() == [eos]
    assert m.accept_token(eos) and m.is_terminated() and not m.accept_token(eos)
