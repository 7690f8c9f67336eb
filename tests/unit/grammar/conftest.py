"""Fixtures of the grammar tests: the tiny models' tokenizer, a padded vocab size, one GrammarBackend."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from radixlm.runtime.constrained import GrammarBackend


@pytest.fixture(scope="session")
def grammar_tokenizer(llama_path: str) -> Any:
    """The tiny models' byte-level BPE tokenizer (ChatML specials, `<|im_end|>` as eos)."""
    return AutoTokenizer.from_pretrained(llama_path)


@pytest.fixture(scope="session")
def vocab_size(grammar_tokenizer: Any) -> int:
    return (len(grammar_tokenizer) + 63) // 64 * 64 + 3  # padded like a model's lm_head, not a multiple of 32


@pytest.fixture(scope="session")
def backend(grammar_tokenizer: Any, vocab_size: int) -> GrammarBackend:
    be = GrammarBackend(grammar_tokenizer, vocab_size, [grammar_tokenizer.eos_token_id])
    yield be
    be.shutdown()
