"""kernels/vocab_mask.py: the packed bit mask against a boolean reference."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.vocab_mask import (
    allocate_vocab_mask,
    apply_vocab_mask,
    set_tokens_allowed,
    vocab_mask_to_bool,
)


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
