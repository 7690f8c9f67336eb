"""Random walks through a compiled grammar (allowed tokens only), for the grammar tests."""

from __future__ import annotations

import random
import time
from collections import deque
from concurrent.futures import Future

import torch

from radixlm.kernels.vocab_mask import allocate_vocab_mask, vocab_mask_to_bool
from radixlm.runtime.constrained import CompiledGrammar, GrammarBackend, GrammarError, GrammarMatcher

SOFT_STEPS = 24  # after this many random steps a walk heads for the nearest final state
MAX_STEPS = 400


def distances_to_final(grammar: CompiledGrammar) -> dict[int, int]:
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
    dist = distances_to_final(grammar)
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
    raise AssertionError(f"walk did not terminate: {decode_ids(grammar, ids)!r}")


def decode_ids(grammar: CompiledGrammar, ids: list[int]) -> str:
    return b"".join(grammar.token_bytes[t] for t in ids).decode("utf-8")  # type: ignore[misc]


def wait_compiled(backend: GrammarBackend, future: Future, timeout: float = 30.0) -> CompiledGrammar | GrammarError:
    started = time.monotonic()
    while True:
        result = backend.poll(future, started)
        if result is not None:
            return result
        assert time.monotonic() - started < timeout
        time.sleep(0.002)
