"""A prefix-cache lint for DSL programs (beyond SGLang).

The radix cache can share a prompt prefix across calls only up to the first character that
differs between them. A program that puts argument text (a timestamp, a user name) in front of a
long constant block (instructions, few-shot examples) makes every call recompute that block.
When tracing sees this before the first generation, we warn once per function with the function
name, the argument, its character offset in the prompt and the `s += ...` line that placed it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .tracer import Segment, TraceResult

# A constant run at least this long (in characters, about 64 tokens) behind argument text is worth
# reordering for. Chat-template markup counts as constant text.
MIN_CONSTANT_CHARS = 256


class PrefixCacheLintWarning(UserWarning):
    """Argument-dependent text sits before a long constant segment, defeating prefix caching."""


@dataclass
class LintIssue:
    function: str
    argument: str | None
    position: int             # character offset of the argument text in the traced prompt
    constant_start: int       # the long constant segment that follows it: [start, end)
    constant_end: int
    location: str | None      # "file.py:LINE" of the `s += ...` that inserted the argument

    def message(self) -> str:
        where = f" ({self.location})" if self.location else ""
        arg = f"argument {self.argument!r}" if self.argument else "argument-dependent text"
        size = self.constant_end - self.constant_start
        return (
            f"radixlm prefix-cache lint: in function {self.function!r}, {arg} is inserted at character "
            f"{self.position} of the prompt{where}, before a {size}-character constant segment "
            f"(characters {self.constant_start}-{self.constant_end}). Every call recomputes that "
            f"segment; move the argument after it so the radix cache can share it across calls."
        )


def find_dynamic_prefix(trace: TraceResult, function: str, min_constant_chars: int = MIN_CONSTANT_CHARS
                        ) -> LintIssue | None:
    """The first argument placed before a long constant segment (looking only before the first
    generation: after it nothing is shared across calls anyway)."""
    first_arg: Segment | None = None
    for seg in trace.segments():
        if seg.kind == "generated":
            return None
        if seg.kind == "argument" and first_arg is None:
            first_arg = seg
        if seg.kind == "constant" and first_arg is not None and seg.end - seg.start >= min_constant_chars:
            insertion = trace.insertion_at(first_arg.start)
            location = f"{insertion.filename}:{insertion.lineno}" if insertion else None
            return LintIssue(function, first_arg.name, first_arg.start, seg.start, seg.end, location)
    return None


def warn_once(owner: object, trace: TraceResult, function: str,
              min_constant_chars: int = MIN_CONSTANT_CHARS) -> LintIssue | None:
    """Checks `trace` and warns the first time `owner` (an SglFunction) shows the problem."""
    if getattr(owner, "_lint_checked", False):
        return None
    issue = find_dynamic_prefix(trace, function, min_constant_chars)
    try:
        owner._lint_checked = True  # type: ignore[attr-defined]
    except AttributeError:
        pass
    if issue is not None:
        warnings.warn(issue.message(), PrefixCacheLintWarning, stacklevel=3)
    return issue
