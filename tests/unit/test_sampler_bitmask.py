"""The sampler applies a grammar's int32 bitmask exactly like the unpacked bool mask."""

from __future__ import annotations

import torch

from radixlm.kernels.vocab_mask import allocate_vocab_mask, set_tokens_allowed, vocab_mask_to_bool
from radixlm.runtime.layers.sampler import process_logits
from radixlm.runtime.layers.sampling_batch_info import SamplingBatchInfo
from radixlm.runtime.sampling_params import SamplingParams


def test_bitmask_and_bool_mask_give_the_same_logits() -> None:
    bs, vocab = 4, 1000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(bs, vocab, generator=gen)
    words = allocate_vocab_mask(bs, vocab)
    words.copy_(torch.randint(-(2**31), 2**31 - 1, words.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    set_tokens_allowed(words[0], [7], allowed=True)
    params = [SamplingParams(min_new_tokens=2 if i == 0 else 0, repetition_penalty=1.2) for i in range(bs)]
    build = lambda mask: SamplingBatchInfo.build(params, [[1, 2]] * bs, [[3]] * bs, vocab, [7], "cpu",  # noqa: E731
                                                 vocab_mask=mask)
    original = logits.clone()
    with_bits = process_logits(logits, build(words))
    with_bool = process_logits(logits, build(vocab_mask_to_bool(words, vocab)))
    assert torch.equal(logits, original)           # never modified in place
    assert torch.equal(with_bits, with_bool)
    assert torch.isneginf(with_bits[~vocab_mask_to_bool(words, vocab)]).all()
