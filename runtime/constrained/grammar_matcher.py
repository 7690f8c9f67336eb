"""GrammarMatcher: one request's position in a compiled grammar (one outlines-core Guide each).

Not thread-safe: a matcher belongs to one request and is driven by the scheduler thread. The compiled
grammar it points to is shared (read-only, plus a locked forced-text memo).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import outlines_core
import torch

from ...kernels.vocab_mask import allocate_vocab_mask, set_tokens_allowed, vocab_mask_to_bool
from .jump_forward import retokenize_forced, valid_utf8_prefix

if TYPE_CHECKING:
    from .grammar_backend import CompiledGrammar

CONTEXT_TOKENS = 8  # tokenizer context for jump_forward_tokens when the caller gives no prev_text


class GrammarMatcher:
    """Tracks accepted tokens, writes vocab masks and finds jump-forward tokens for one request."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.guide = outlines_core.Guide(grammar.index)
        self.accepted_ids: list[int] = []  # every non-eos token accepted so far (jump-forward ones too)
        self.jump_forward_count = 0  # tokens added by jump_forward_tokens
        self.terminated = False  # an eos was accepted in a final state

    # ------------------------------------------------------------------ state
    def is_terminated(self) -> bool:
        """True once an eos token was accepted; no token is accepted after that."""
        return self.terminated

    def is_final(self) -> bool:
        """True when the text so far is a complete match (eos is allowed now)."""
        return self.terminated or self.guide.is_finished()

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (replays the accepted tokens on a fresh Guide)."""
        other = GrammarMatcher(self.grammar)
        for tid in self.accepted_ids:
            other.guide.advance(tid, return_tokens=False)
        other.accepted_ids = list(self.accepted_ids)
        other.jump_forward_count = self.jump_forward_count
        other.terminated = self.terminated
        return other

    # ------------------------------------------------------------------ tokens
    def accept_token(self, tid: int) -> bool:
        """Advance by one token. Returns False (state unchanged) if the grammar does not allow it.

        An eos id is accepted only in a final state, and terminates the matcher.
        """
        if self.terminated:
            return False
        if tid in self.grammar.eos_token_ids:
            if not self.guide.is_finished():
                return False
            self.terminated = True
            return True
        if tid == self.grammar.vocab_eos_id or not self._in_vocab(tid):
            return False
        try:
            self.guide.advance(tid, return_tokens=False)
        except ValueError:
            return False
        self.accepted_ids.append(tid)
        return True

    def fill_vocab_mask(self, mask_row: torch.Tensor) -> None:
        """Write the allowed tokens into one mask row, in place.

        mask_row: a contiguous CPU int32 bitmask row (`radixlm.kernels.vocab_mask` layout, the fast
        path), or a bool row of length >= vocab_size (True = allowed; bits past vocab_size cleared).
        Allowed: the tokens the grammar accepts next, plus every eos id iff the state is final.
        Tokens the index does not know (special tokens, padded ids) are never allowed.
        """
        if mask_row.dtype == torch.bool:
            words = allocate_vocab_mask(1, mask_row.numel())
            self.fill_vocab_mask(words[0])
            mask_row.copy_(vocab_mask_to_bool(words, mask_row.numel())[0])
            return
        words = mask_row.numel()
        if mask_row.dtype != torch.int32 or not mask_row.is_contiguous() or mask_row.device.type != "cpu":
            raise ValueError("fill_vocab_mask needs a contiguous CPU int32 row (or a bool row)")
        if words * 32 < self.grammar.vocab_size:
            raise ValueError(f"mask row has {words} words, too few for a vocab of {self.grammar.vocab_size}")
        if self.terminated:
            mask_row.zero_()
        else:
            self.guide.write_mask_into(mask_row.data_ptr(), words, 4)
            set_tokens_allowed(mask_row, [self.grammar.vocab_eos_id], allowed=False)
        set_tokens_allowed(mask_row, self.grammar.eos_token_ids, allowed=self.is_final())

    def allowed_token_ids(self) -> list[int]:
        """The tokens `accept_token` would accept now (eos ids included iff final). Slow; for tests."""
        if self.terminated:
            return []
        ids = [t for t in self.guide.get_tokens() if t != self.grammar.vocab_eos_id]
        if self.guide.is_finished():
            ids.extend(self.grammar.eos_token_ids)
        return ids

    def _in_vocab(self, tid: int) -> bool:
        return 0 <= tid < self.grammar.vocab_size and self.grammar.token_bytes[tid] is not None

    # ------------------------------------------------------------------ jump-forward
    def find_jump_forward(self) -> str | None:
        """The text every allowed continuation starts with, or None when nothing is forced.

        Gives up (returns a shorter text or None) when the allowed token set is large. Cached per
        grammar state, so repeated calls in an open state (inside a JSON string) are cheap.
        """
        if self.terminated:
            return None
        forced = self.grammar.forced_text.forced_bytes(self.guide.get_state())
        return valid_utf8_prefix(forced) or None

    def jump_forward_tokens(self, prev_text: str | None = None) -> list[int] | None:
        """Tokens for the forced text, accepted into this matcher; None (matcher unchanged) if no jump.

        prev_text is the output text generated just before this point (its last few tokens decoded,
        or all of it); it is the tokenizer context for the boundary check described in
        `jump_forward.retokenize_forced`. None uses the decoded last `CONTEXT_TOKENS` accepted tokens.
        The returned tokens decode to exactly the forced text and are what the tokenizer gives for it
        after prev_text.
        """
        forced = self.find_jump_forward()
        if not forced:
            return None
        if prev_text is None:
            recent = self.accepted_ids[-CONTEXT_TOKENS:]
            prev_text = b"".join(self.grammar.token_bytes[t] for t in recent).decode("utf-8", "replace")  # type: ignore[misc]
        tail = retokenize_forced(self.grammar.tokenizer, prev_text, forced)
        if tail is None or not all(self._in_vocab(t) for t in tail):
            return None
        if b"".join(self.grammar.token_bytes[t] for t in tail) != forced.encode("utf-8"):  # type: ignore[misc]
            return None
        state = self.guide.get_state()
        for tid in tail:  # check the whole span before touching the guide
            state = self.grammar.index.get_next_state(state, tid)
            if state is None:
                return None
        for tid in tail:
            self.guide.advance(tid, return_tokens=False)
        self.accepted_ids.extend(tail)
        self.jump_forward_count += len(tail)
        return tail
