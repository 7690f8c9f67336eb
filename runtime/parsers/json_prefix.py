"""How much of a text is the start of a JSON value: lets a stream send tool-call arguments as they grow.

`json_prefix_end(text, start)` scans one value and returns (end, complete): `text[start:end]` is the
longest prefix that some valid JSON value starts with, and `complete` says the value closed exactly at
`end`. It is monotone: for a longer text, end never moves back, so what was sent stays a prefix.
"""

from __future__ import annotations

import re

_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")


def json_prefix_end(text: str, start: int) -> tuple[int, bool]:
    """Scans one JSON value from `start`: (end, complete). text[start:end] is the longest prefix that
    some valid JSON value starts with; complete means the value closed exactly at `end`."""
    stack: list[str] = []          # open containers: "{" or "["
    expect = "value"               # value | key | colon | comma_or_close | key_or_close | value_or_close
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if expect in ("value", "value_or_close"):
            if expect == "value_or_close" and c == "]":
                stack.pop()
                i += 1
                expect = "comma_or_close" if stack else "done"
            elif c in "{[":
                stack.append(c)
                i += 1
                expect = "key_or_close" if c == "{" else "value_or_close"
            elif c == '"':
                j = _string_end(text, i)
                if j is None:
                    return _partial_string(text, i), False
                i = j
                expect = "comma_or_close" if stack else "done"
            elif c in "-0123456789":
                j, ok = _number_end(text, i)
                if not ok or j == n:
                    return j, False         # invalid from j on, or a number that can go on
                i = j
                expect = "comma_or_close" if stack else "done"
            elif c in "tfn":
                word = next((w for w in _LITERALS if w[0] == c), "")
                piece = text[i:i + len(word)]
                if not word.startswith(piece):
                    return i + _common(word, piece), False
                if len(piece) < len(word):
                    return n, False
                i += len(word)
                expect = "comma_or_close" if stack else "done"
            else:
                return i, False
        elif expect in ("key", "key_or_close"):
            if expect == "key_or_close" and c == "}":
                stack.pop()
                i += 1
                expect = "comma_or_close" if stack else "done"
            elif c == '"':
                j = _string_end(text, i)
                if j is None:
                    return _partial_string(text, i), False
                i = j
                expect = "colon"
            else:
                return i, False
        elif expect == "colon":
            if c != ":":
                return i, False
            i += 1
            expect = "value"
        elif expect == "comma_or_close":
            top = stack[-1]
            if c == ",":
                i += 1
                expect = "key" if top == "{" else "value"
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                stack.pop()
                i += 1
                expect = "comma_or_close" if stack else "done"
            else:
                return i, False
        if expect == "done":
            return i, True
    return n, False


_NUMBER_CHARS = set("0123456789+-.eE")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


_NUMBER_PREFIX = re.compile(r"-|-?(0|[1-9][0-9]*)(\.[0-9]*)?([eE][+-]?[0-9]*)?")


def _number_end(text: str, i: int) -> tuple[int, bool]:
    """(end, ok) of the number at i: ok with the end of a finished number (or of the text); else
    end is where the run stops being the start of a JSON number."""
    j = i
    while j < len(text) and text[j] in _NUMBER_CHARS:
        j += 1
    if j < len(text) and _NUMBER.fullmatch(text, i, j):
        return j, True
    k = j
    while k > i and not _NUMBER_PREFIX.fullmatch(text, i, k):
        k -= 1
    return k, k == j == len(text)


def _string_end(text: str, i: int) -> int | None:
    """The index after the closing quote of the string at i; None when it is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if ord(c) < 0x20:
            return None
        j += 1
    return None


def _partial_string(text: str, i: int) -> int:
    """How far an unclosed string at i is valid: to the end, or up to a raw control character."""
    for j in range(i + 1, len(text)):
        if ord(text[j]) < 0x20:
            return j
    return len(text)


def _common(a: str, b: str) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k
