"""Constraint text -> the regex a grammar engine compiles: anchors, `\\d`, and JSON whitespace.

- `normalize_regex`: constraints must match the whole output anyway, so `^` at the start of a
  branch and `$` at its end are dropped (outlines-core refuses anchored patterns); `\\d` becomes
  `[0-9]` and `\\D` `[^0-9]`, as in SGLang's default backend (Rust's `\\d` is any Unicode digit,
  such as `４`). Everything else is passed through unchanged.
- `schema_to_regex`: a JSON schema's regex. By default (`whitespace_pattern=None`) the output is
  laid out the way `json.dumps` writes it: `", "` between items and `": "` after keys, nothing
  else. Each separator is a fixed string, so it is forced text that jump-forward appends without
  decode steps. A `whitespace_pattern` (`--constrained-json-whitespace-pattern`) is allowed at every
  place JSON allows whitespace instead: the model chooses, at one decode step per choice.
"""

from __future__ import annotations

import json

from outlines_core.json_schema import build_regex_from_schema

# None: json.dumps layout (see the module docstring); a regex: whitespace the model may choose
DEFAULT_JSON_WHITESPACE_PATTERN: str | None = None
# response_format {"type": "json_object"}: any JSON object, see `any_json_object_regex`
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_JSON_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_JSON_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_WS_MARK = "\ue000"  # a private-use character standing for "whitespace goes here"


class GrammarError(ValueError):
    """A constraint that cannot be used; the message is meant for the client (HTTP 400)."""


def normalize_regex(regex: str) -> str:
    """`regex` with branch-edge anchors removed and `\\d`/`\\D` spelled as ASCII classes."""
    out: list[str] = []
    i, n, in_class = 0, len(regex), False
    while i < n:
        ch = regex[i]
        if ch == "\\" and i + 1 < n:
            nxt = regex[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(ch + nxt)
            i += 2
            continue
        if in_class:
            in_class = ch != "]" or _class_opened_at(out)
            out.append(ch)
        elif ch == "[":
            in_class = True
            out.append(ch)
        elif ch == "^" and _at_branch_start(out):
            pass
        elif ch == "$" and (i + 1 == n or regex[i + 1] in "|)"):
            pass
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _at_branch_start(out: list[str]) -> bool:
    text = "".join(out[-3:])
    return not out or text.endswith(("(", "|", "(?:"))


def _class_opened_at(out: list[str]) -> bool:
    """True when a `]` right here is a literal (first character of the class, or after `[^`)."""
    return bool(out) and (out[-1] == "[" or (out[-1] == "^" and len(out) > 1 and out[-2] == "["))


def any_json_object_regex(whitespace_pattern: str | None, depth: int = 1) -> str:
    """A JSON object whose values nest at most `depth` more arrays/objects deep.

    outlines-core's regex for a property-less `{"type": "object"}` nests three levels and takes ~5 s
    to index with a 32k vocab; depth 1 (values: scalars, flat arrays, flat objects) takes ~0.3 s.
    """
    ws = f"({whitespace_pattern})" if whitespace_pattern else ""
    comma, colon = (f"{ws},{ws}", f"{ws}:{ws}") if whitespace_pattern is not None else (", ", ": ")
    scalar = f"({_JSON_STRING}|{_JSON_NUMBER}|true|false|null)"

    def value(level: int) -> str:
        return scalar if level == 0 else f"({scalar}|{array(level - 1)}|{obj(level - 1)})"

    def array(level: int) -> str:
        item = value(level)
        return rf"\[{ws}({item}({comma}{item})*)?{ws}\]"

    def obj(level: int) -> str:
        member = f"{_JSON_STRING}{colon}{value(level)}"
        return rf"\{{{ws}({member}({comma}{member})*)?{ws}\}}"

    return obj(depth)


def schema_to_regex(spec: str, whitespace_pattern: str | None) -> str:
    """The regex of a JSON schema given as a JSON string; GrammarError if it is invalid."""
    try:
        parsed = json.loads(spec)
    except (TypeError, json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"Invalid JSON schema: not valid JSON ({e})") from None
    if not isinstance(parsed, (dict, bool)):
        raise GrammarError("Invalid JSON schema: a schema must be a JSON object")
    if parsed == {"type": "object"}:
        return any_json_object_regex(whitespace_pattern)
    dumps_style = whitespace_pattern is None and _WS_MARK not in spec
    pattern = _WS_MARK if dumps_style else (whitespace_pattern or "")
    try:
        regex = build_regex_from_schema(spec, whitespace_pattern=pattern)
    except Exception as e:  # outlines-core raises ValueError / TypeError with multi-line messages
        raise GrammarError(f"Invalid JSON schema: {one_line(e)}") from None
    return normalize_regex(_dumps_separators(regex) if dumps_style else regex)


def _dumps_separators(regex: str) -> str:
    """Replace the whitespace marks outlines-core placed with json.dumps' fixed separators."""
    m = _WS_MARK
    regex = regex.replace(f"{m},{m}", ", ").replace(f",{m}", ", ").replace(f"{m}:{m}", ": ")
    return regex.replace(m, "")


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
