"""XGrammarMatcher: one request's position in an xgrammar grammar (regex, JSON, EBNF, structural tag).

Same interface as the outlines-core `GrammarMatcher`, so the scheduler does not care which engine
compiled a constraint. Not thread-safe: a matcher belongs to one request (the scheduler thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...kernels.vocab_mask import allocate_vocab_mask, vocab_mask_to_bool
from .grammar_matcher import CONTEXT_TOKENS
from .jump_forward import retokenize_forced


@dataclass
class XGrammarCompiled:
    """One compiled xgrammar constraint, shared read-only by the requests that use it."""

    kind: str
    spec: str
    compiled: Any = field(repr=False)            # xgrammar.CompiledGrammar
    tokenizer: Any = field(repr=False)
    token_bytes: list[bytes | None] = field(repr=False)
    vocab_size: int
    eos_token_ids: frozenset[int]
    compile_time_s: float
    regex: str | None = None

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self)


class XGrammarMatcher:
    """Tracks accepted tokens, writes vocab masks and finds jump-forward tokens for one request."""

    def __init__(self, grammar: XGrammarCompiled, matcher: Any = None) -> None:
        import xgrammar as xgr

        self.grammar = grammar
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(grammar.compiled)
        self.accepted_ids: list[int] = []
        self.jump_forward_count = 0

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def is_final(self) -> bool:
        return self.matcher.is_terminated() or self.matcher.is_completed()

    def copy(self) -> XGrammarMatcher:
        other = XGrammarMatcher(self.grammar, self.matcher.fork())
        other.accepted_ids = list(self.accepted_ids)
        other.jump_forward_count = self.jump_forward_count
        return other

    def accept_token(self, tid: int) -> bool:
        """Advance by one token; False (state unchanged) if not allowed. An eos terminates."""
        if self.matcher.is_terminated() or not 0 <= tid < self.grammar.vocab_size:
            return False
        if not self.matcher.accept_token(tid):
            return False
        if tid not in self.grammar.eos_token_ids:
            self.accepted_ids.append(tid)
        return True

    def fill_vocab_mask(self, mask_row: torch.Tensor) -> None:
        """Write the allowed tokens into one int32 bitmask row (or a bool row), in place."""
        if mask_row.dtype == torch.bool:
            words = allocate_vocab_mask(1, mask_row.numel())
            self.fill_vocab_mask(words[0])
            mask_row.copy_(vocab_mask_to_bool(words, mask_row.numel())[0])
            return
        if mask_row.dtype != torch.int32 or not mask_row.is_contiguous() or mask_row.device.type != "cpu":
            raise ValueError("fill_vocab_mask needs a contiguous CPU int32 row (or a bool row)")
        if self.matcher.is_terminated():
            mask_row.zero_()
            return
        self.matcher.fill_next_token_bitmask(mask_row.unsqueeze(0), 0)

    def allowed_token_ids(self) -> list[int]:
        """The tokens `accept_token` would accept now. Slow; for tests."""
        words = allocate_vocab_mask(1, self.grammar.vocab_size)
        self.fill_vocab_mask(words[0])
        return vocab_mask_to_bool(words, self.grammar.vocab_size)[0].nonzero().flatten().tolist()

    def find_jump_forward(self) -> str | None:
        if self.matcher.is_terminated():
            return None
        return self.matcher.find_jump_forward_string() or None

    def jump_forward_tokens(self, prev_text: str | None = None) -> list[int] | None:
        """Tokens for the forced text, accepted into this matcher; None (unchanged) if no jump."""
        forced = self.find_jump_forward()
        if not forced:
            return None
        if prev_text is None:
            recent = self.accepted_ids[-CONTEXT_TOKENS:]
            prev_text = b"".join(self.grammar.token_bytes[t] or b"" for t in recent).decode("utf-8", "replace")
        tail = retokenize_forced(self.grammar.tokenizer, prev_text, forced)
        if not tail or any(not 0 <= t < self.grammar.vocab_size or self.grammar.token_bytes[t] is None
                           for t in tail):
            return None
        if b"".join(self.grammar.token_bytes[t] for t in tail) != forced.encode("utf-8"):  # type: ignore[misc]
            return None
        probe = self.matcher.fork()
        if not all(probe.accept_token(t) for t in tail):
            return None
        self.matcher = probe
        self.accepted_ids.extend(tail)
        self.jump_forward_count += len(tail)
        return tail
