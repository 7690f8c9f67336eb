"""Reasoning parsers: split a model's output into `reasoning_content` and `content`.

Formats (`--reasoning-parser NAME`):
  qwen3        `<think>...</think>` at the start of the output; no opening tag means no reasoning
               (Qwen3 with `enable_thinking: false` gets an empty think block in its prompt).
  deepseek-r1  the output starts inside the reasoning (the template opened `<think>`), so all text up
  (qwen3-thinking)  to `</think>` is reasoning; an opening `<think>` in the output is skipped.

`scan(text, final)` is the whole parser. It is monotone: for a prefix of the text (final=False) each
field it returns is a prefix of the field for the whole text (final=True), so a stream can send the
growth of each field as deltas and the deltas add up to the non-streamed result. It holds back what
is not decided yet: a partial `</think>` at the end, and whitespace at the end of the reasoning
(reasoning is stripped; content after `</think>` loses its leading whitespace).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningScan:
    reasoning: str
    content: str


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """`<think>`-style reasoning; `forced` means the output starts inside the reasoning."""

    def __init__(self, name: str, forced: bool, start: str = THINK_START, end: str = THINK_END):
        self.name = name
        self.forced = forced
        self.start = start
        self.end = end

    def scan(self, text: str, final: bool) -> ReasoningScan:
        """(reasoning, content) for the text so far; see the module docstring. Pure function."""
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):]
        elif not self.forced:
            if not final and body and self.start.startswith(body):
                return ReasoningScan("", "")           # maybe the opening tag: decide later
            return ReasoningScan("", text)
        elif not final and body and self.start.startswith(body):
            return ReasoningScan("", "")
        end = body.find(self.end)
        if end < 0:
            if final:
                return ReasoningScan(body.strip(), "")
            held = partial_suffix(body, self.end)
            return ReasoningScan(body[:len(body) - held].strip(), "")
        return ReasoningScan(body[:end].strip(), body[end + len(self.end):].lstrip())

    def prefix_regex(self) -> str:
        """A regex for the reasoning part a constrained output may start with (Rust regex syntax).

        The constraint is then `prefix_regex() + constraint`: the grammar lets the model think freely
        and applies only after the reasoning ends. qwen3's block is optional.
        """
        block = text_until(self.end) + r"[ \t\n]*"
        if self.forced:
            return f"(?:{re.escape(self.start)})?" + block
        return f"(?:{re.escape(self.start)}{block})?"


def text_until(terminator: str) -> str:
    """A regex for: any text without `terminator`, then `terminator` (its first char must not repeat in it).

    Items are a char other than the first char F, or a run of broken attempts: `F` + a proper prefix
    of the rest that is cut by another `F`, ending in a char that continues neither. A DFA needs no
    lookaround for this, so outlines-core can index it.
    """
    first, rest = terminator[0], terminator[1:]
    if first in rest:
        raise ValueError(f"text_until needs a terminator whose first char does not repeat: {terminator!r}")
    f, esc = re.escape(first), [re.escape(c) for c in rest]
    proper = "".join(f"(?:{c}" for c in esc[:-1]) + ")?" * (len(esc) - 1)   # a proper prefix of rest
    runs = f"(?:{f}{proper})*"                                          # attempts cut by another F
    breaks = [f"{f}{''.join(esc[:k])}[^{_cls(first)}{_cls(rest[k])}]" for k in range(len(rest))]
    item = f"(?:[^{_cls(first)}]|{runs}(?:{'|'.join(breaks)}))"
    return f"{item}*{runs}{re.escape(terminator)}"


def _cls(char: str) -> str:
    return "\\" + char if char in "\\]^-[" else char


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", forced=False),
    "deepseek-r1": ReasoningParser("deepseek-r1", forced=True),
    "qwen3-thinking": ReasoningParser("qwen3-thinking", forced=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The registered parser; ValueError naming the choices for an unknown name."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") from None
