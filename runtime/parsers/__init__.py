"""Output parsers for chat: reasoning (`reasoning.py`) and tool calls (`tool_call.py`), and the
combination the OpenAI layer uses for whole responses and for streams.

`ChatOutputParser.parse(text, final)` runs the reasoning parser first, then the tool-call parser on
the content it leaves. Both are monotone in the text (see their module docstrings), so
`ChatStreamState.delta(text, final)` can send only what grew, and a stream's deltas add up to the
non-streamed message exactly.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from .reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser
from .tool_call import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallParser,
    get_tool_call_parser,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChatOutputParser",
    "ChatStreamState",
    "ParsedOutput",
    "ReasoningParser",
    "ToolCall",
    "ToolCallParser",
    "get_reasoning_parser",
    "get_tool_call_parser",
    "new_call_id",
]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ParsedOutput:
    reasoning: str | None = None       # None: no reasoning parser (or separate_reasoning false)
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    """One request's parsers. tool_names: the names calls may use (None: any)."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None,
                 tool_names: set[str] | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.tool_names = tool_names

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The message fields for the output text so far (final: the text is complete). Pure."""
        out = ParsedOutput(content=text)
        if self.reasoning is not None:
            split = self.reasoning.scan(text, final)
            out.reasoning, out.content = split.reasoning, split.content
        if self.tools is not None:
            scan = self.tools.scan(out.content, final, self.tool_names)
            out.content, out.calls = scan.content, scan.calls
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The OpenAI `message` of a whole response."""
        parsed = self.parse(text, final=True)
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            msg["reasoning_content"] = parsed.reasoning or None
        if parsed.calls:
            msg["content"] = parsed.content or None
            msg["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
        return msg


class ChatStreamState:
    """What one streamed choice has sent; `delta` returns the new fields (mutates the counters)."""

    def __init__(self, parser: ChatOutputParser):
        self.parser = parser
        self.reasoning_len = 0
        self.content_len = 0
        self.calls_sent = 0
        self.args_sent: list[int] = []      # chars of each call's arguments sent

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        parsed = self.parser.parse(text, final)
        delta: dict[str, Any] = {}
        if parsed.reasoning is not None and len(parsed.reasoning) > self.reasoning_len:
            delta["reasoning_content"] = parsed.reasoning[self.reasoning_len:]
            self.reasoning_len = len(parsed.reasoning)
        if len(parsed.content) > self.content_len:
            delta["content"] = parsed.content[self.content_len:]
            self.content_len = len(parsed.content)
        calls = []
        for i, call in enumerate(parsed.calls):
            if i >= len(self.args_sent):   # a new call: id, name and the arguments so far
                calls.append({"index": i, "id": new_call_id(), "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
                self.args_sent.append(len(call.arguments))
            elif len(call.arguments) > self.args_sent[i]:   # more of a call's arguments
                calls.append({"index": i, "function": {"arguments": call.arguments[self.args_sent[i]:]}})
                self.args_sent[i] = len(call.arguments)
        self.calls_sent = len(self.args_sent)
        if calls:
            delta["tool_calls"] = calls
        return delta
