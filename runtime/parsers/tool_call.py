"""Tool-call parsers: find the function calls a model wrote in its output (`--tool-call-parser NAME`).

Formats (the names SGLang uses):
  hermes, qwen25  `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call
  llama3          `{"name": "f", "parameters": {...}}` as the whole output, optionally after
                  `<|python_tag|>`; several calls separated by `;`
  mistral         `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`
  pythonic        `[f(a=1, b="x"), g()]` as the whole output (Python literals only)

`scan(text, final)` returns the content (text outside calls; whitespace next to a call dropped) and
the calls, each with `arguments` as a JSON string. A call whose text does not parse (bad JSON, a name
not among the request's tools) stays in the content as it was written.

Monotone, as the reasoning parser: for a prefix of the output (final=False) the content is a prefix
of the final content, each call's name is final once reported and its arguments a prefix of the
final arguments, so a stream sends only growth. hermes streams arguments as they are written (see
HermesParser); the other formats report a call once its text is complete (the JSON / Python value
closing), so its arguments arrive in one fragment. Text that may still become a call is held back.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .json_prefix import json_prefix_end
from .reasoning import partial_suffix

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # a JSON object as text


@dataclass
class ToolScan:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class _Builder:
    """Accumulates content pieces and calls; drops the whitespace that touches a call."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.calls: list[ToolCall] = []
        self.after_call = False

    def text(self, piece: str) -> None:
        if self.after_call:
            piece = piece.lstrip()
        if piece:
            self.after_call = False
            self.pieces.append(piece)

    def call(self, call: ToolCall) -> None:
        if self.pieces:
            self.pieces[-1] = self.pieces[-1].rstrip()
        self.calls.append(call)
        self.after_call = True

    def result(self, final: bool, hold: int = 0) -> ToolScan:
        """hold: chars at the end of the text not yet decided (a possible marker start)."""
        content = "".join(self.pieces)
        if not final:   # trailing whitespace may yet touch a call
            content = content[:len(content) - hold] if hold else content
            content = content.rstrip()
        return ToolScan(content, list(self.calls))


def _call_from_json(obj: Any, names: set[str] | None, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Base: `scan` is the parser; `call_regex` the format a tool_choice constraint forces."""

    name = ""

    def scan(self, text: str, final: bool, names: set[str] | None = None) -> ToolScan:
        raise NotImplementedError

    def call_regex(self, name: str, args_regex: str) -> str:
        """A regex for one call of `name` whose arguments match args_regex."""
        raise NotImplementedError

    def calls_regex(self, calls: list[str], parallel: bool) -> str:
        """A regex for one call (or, with parallel, one or more) out of the alternatives `calls`."""
        one = "(?:" + "|".join(calls) + ")"
        return one + (f"(?:{self.separator}{one})*" if parallel else "")

    separator = "\n"


class HermesParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3).

    A block that starts `{"name": "<known tool>", "arguments": {` is a call from then on: its
    arguments stream as they grow (the raw text, as long as it is the start of a JSON value). If
    they turn out malformed, the call keeps the arguments up to the error and the rest of the block
    becomes content. Other blocks (other key order, unknown name, bad JSON) are decided when they
    close: a call (arguments re-serialized) or content.
    """

    start, end = "<tool_call>", "</tool_call>"
    header = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')

    def scan(self, text: str, final: bool, names: set[str] | None = None) -> ToolScan:
        out = _Builder()
        pos = 0
        while True:
            at = text.find(self.start, pos)
            if at < 0:
                out.text(text[pos:])
                return out.result(final, 0 if final else partial_suffix(text[pos:], self.start))
            out.text(text[pos:at])
            close = text.find(self.end, at)
            closed = close >= 0 or final
            inner_end = len(text) if close < 0 else close
            block_end = len(text) if close < 0 else close + len(self.end)
            inner = text[at + len(self.start):inner_end]
            head = self.header.match(inner)
            if head and (names is None or head.group(1) in names):
                args_end, _ = json_prefix_end(inner, head.end())
                out.call(ToolCall(head.group(1), inner[head.end():args_end]))
                if not closed:
                    return out.result(final)        # the call is still growing
                rest = inner[args_end:]
                if rest.strip() != "}":
                    out.text(rest)
            elif not closed:
                return out.result(final)            # an open block: decided when it closes
            else:
                call = self._parse_block(inner, names)
                if call is None:
                    out.text(text[at:block_end])
                else:
                    out.call(call)
            pos = block_end

    @staticmethod
    def _parse_block(inner: str, names: set[str] | None) -> ToolCall | None:
        try:
            obj = json.loads(inner)
        except json.JSONDecodeError:
            return None
        return _call_from_json(obj, names, ("arguments", "parameters"))

    def call_regex(self, name: str, args_regex: str) -> str:
        return re.escape(f'<tool_call>\n{{"name": "{name}", "arguments": ') + args_regex + re.escape("}\n</tool_call>")


class _JsonListParser(ToolCallParser):
    """Shared by llama3 and mistral: a marker (or the output start) followed by JSON call objects."""

    marker = ""
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def _calls_from(self, value: Any, names: set[str] | None) -> list[ToolCall] | None:
        items = value if isinstance(value, list) else [value]
        calls = [_call_from_json(v, names, self.args_keys) for v in items]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


class Llama3Parser(_JsonListParser):
    """Llama 3.1/3.2 JSON calls: `{"name": ..., "parameters": ...}` (`;`-separated), `<|python_tag|>` optional."""

    marker = "<|python_tag|>"
    args_keys = ("parameters", "arguments")
    separator = "; "

    def scan(self, text: str, final: bool, names: set[str] | None = None) -> ToolScan:
        out = _Builder()
        at = text.find(self.marker)
        if at >= 0:
            out.text(text[:at])
            start = at + len(self.marker)
        elif text.lstrip().startswith("{"):
            start = len(text) - len(text.lstrip())
        else:
            stripped = text.lstrip()
            if not final and (not stripped or self.marker.startswith(stripped)):
                return ToolScan()
            out.text(text)
            return out.result(final, 0 if final else partial_suffix(text, self.marker))
        calls, end, complete = self._parse_calls(text, start, names)
        if not calls:
            if final:
                out.text(text[start if at < 0 else at:])
            return out.result(final)
        for call in calls:                     # calls parsed so far stand (monotone)
            out.call(call)
        if complete or final:
            out.text(text[end:])
        return out.result(final)

    def _parse_calls(self, text: str, pos: int, names: set[str] | None) -> tuple[list[ToolCall], int, bool]:
        """`obj (; obj)*` from pos: (calls parsed, where the rest starts, whether the rest is only
        whitespace). A failing or unfinished object ends the list; the rest starts at its `;`."""
        calls: list[ToolCall] = []
        while True:
            start = pos
            while pos < len(text) and text[pos].isspace():
                pos += 1
            try:
                obj, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                return calls, start, False
            call = _call_from_json(obj, names, self.args_keys)
            if call is None:
                return calls, start, False
            calls.append(call)
            rest = text[pos:].lstrip()
            if not rest.startswith(";"):
                return calls, pos, not rest
            pos = text.index(";", pos) + 1

    def call_regex(self, name: str, args_regex: str) -> str:
        return re.escape(f'{{"name": "{name}", "parameters": ') + args_regex + r"\}"


class MistralParser(_JsonListParser):
    """`[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]` (Mistral v3 tokenizer format)."""

    marker = "[TOOL_CALLS]"

    def scan(self, text: str, final: bool, names: set[str] | None = None) -> ToolScan:
        out = _Builder()
        at = text.find(self.marker)
        if at < 0:
            out.text(text)
            return out.result(final, 0 if final else partial_suffix(text, self.marker))
        out.text(text[:at])
        start = at + len(self.marker)
        body = text[start:]
        lead = len(body) - len(body.lstrip())
        try:
            value, end = _DECODER.raw_decode(text, start + lead)
        except json.JSONDecodeError:
            if final:
                out.text(text[at:])
            return out.result(final)
        calls = self._calls_from(value, names)
        if calls is None:
            out.text(text[at:end])
        else:
            for call in calls:
                out.call(call)
        out.text(text[end:])
        return out.result(final)

    def call_regex(self, name: str, args_regex: str) -> str:
        return re.escape(f'{{"name": "{name}", "arguments": ') + args_regex + r"\}"

    def calls_regex(self, calls: list[str], parallel: bool) -> str:
        one = "(?:" + "|".join(calls) + ")"
        return re.escape("[TOOL_CALLS] [") + one + (f"(?:, {one})*" if parallel else "") + r"\]"


class PythonicParser(ToolCallParser):
    """`[f(a=1), g(b="x")]`: a Python list of calls with literal keyword arguments (Llama 4, Llama 3.2)."""

    def scan(self, text: str, final: bool, names: set[str] | None = None) -> ToolScan:
        out = _Builder()
        stripped = text.strip()
        if not stripped.startswith("["):
            if not final and not stripped:
                return ToolScan()
            out.text(text)
            return out.result(final)
        calls = self._parse(stripped, names) if stripped.endswith("]") else None
        if calls is None:
            if final:
                out.text(text)
            return out.result(final)
        for call in calls:
            out.call(call)
        return out.result(final)

    @staticmethod
    def _parse(source: str, names: set[str] | None) -> list[ToolCall] | None:
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            if names is not None and node.func.id not in names:
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            except (ValueError, SyntaxError):
                return None
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls

    def call_regex(self, name: str, args_regex: str) -> str:
        raise ValueError("tool_choice 'required' or a named function cannot be enforced with the pythonic "
                         "parser (its arguments are not JSON); use tool_choice 'auto'")


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen3": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}


def get_tool_call_parser(name: str) -> ToolCallParser:
    """A parser instance; ValueError naming the choices for an unknown name."""
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"Unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}") from None
