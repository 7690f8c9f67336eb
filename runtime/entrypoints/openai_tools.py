"""Tools, tool_choice and reasoning for `/v1/chat/completions`: what the template gets, what the
output parser looks for, and the grammar constraint that enforces a call.

    tool_choice   tools rendered   output parsed for calls   constraint
    none          no               no                        (the request's own, if any)
    auto          yes              yes (with a parser)       (the request's own, if any)
    required      yes              yes                       one call of any tool (several with
                                                             parallel_tool_calls)
    {function}    yes              yes                       one call of that function

Enforcement uses the ordinary `regex` sampling parameter: the parser's call format with the
arguments' JSON-schema regex inside. Arguments are generated in the spacing `json.dumps` (and the
templates' `tojson`) writes, `{"a": 1, "b": [2, 3]}`, so a call rendered back into the next turn's
prompt repeats the generated text byte for byte. With a reasoning parser, tool_choice and
`response_format` constraints are prefixed by the reasoning block, so they apply only after the
reasoning ends (the low-level `regex` / `json_schema` extras constrain the whole output). Errors are APIError 400s that name the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..constrained import DEFAULT_JSON_WHITESPACE_PATTERN, GrammarError, schema_to_regex
from ..parsers import ChatOutputParser, ReasoningParser, ToolCallParser
from .errors import APIError


@dataclass
class ToolSetup:
    tools: list[dict[str, Any]] | None      # passed to the chat template
    parse_names: set[str] | None            # tool names the output parser accepts (None: no parsing)
    constraint: str | None                  # a regex forcing a call, or None


def check_tools(req: Any) -> list[dict[str, Any]] | None:
    """`tools` (or legacy `functions`) as OpenAI tool objects; APIError 400 when malformed."""
    if req.tools is not None and req.functions is not None:
        raise APIError(400, "Use either tools or functions, not both", param="functions")
    raw = req.tools if req.tools is not None else (
        [{"type": "function", "function": f} for f in req.functions] if req.functions is not None else None)
    if not raw:
        return None
    out, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, f"{where}.type must be 'function'", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"{where}.function.name is required", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
        if fn["name"] in seen:
            raise APIError(400, f"{where}.function.name {fn['name']!r} is used twice", param="tools")
        seen.add(fn["name"])
        out.append({**tool, "type": "function"})
    return out


def legacy_tool_choice(req: Any) -> Any:
    """tool_choice, or the legacy `function_call` mapped onto it."""
    call = (req.model_extra or {}).get("function_call")
    if call is None:
        return req.tool_choice
    if req.tool_choice is not None:
        raise APIError(400, "Use either tool_choice or function_call, not both", param="function_call")
    if isinstance(call, dict) and isinstance(call.get("name"), str):
        return {"type": "function", "function": {"name": call["name"]}}
    return call


def setup_tools(req: Any, parser: ToolCallParser | None, reasoning: ReasoningParser | None) -> ToolSetup:
    """Validates tools / tool_choice and builds what the request needs; APIError 400 on misuse."""
    tools = check_tools(req)
    choice = legacy_tool_choice(req)
    if choice is not None and not tools:
        raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    if not tools:
        return ToolSetup(None, None, None)
    choice = "auto" if choice is None else choice
    names = [t["function"]["name"] for t in tools]
    if choice == "none":
        return ToolSetup(None, None, None)
    if choice == "auto":
        return ToolSetup(tools, set(names) if parser else None, None)
    if choice == "required":
        chosen = tools
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools",
                           param="tool_choice")
        chosen = [t for t in tools if t["function"]["name"] == name]
    else:
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if parser is None:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'with a function'} needs a "
                            "server started with --tool-call-parser", param="tool_choice")
    for name in ("regex", "json_schema", "ebnf", "response_format"):
        if getattr(req, name, None) is not None and not (name == "response_format" and req.response_format.type == "text"):
            raise APIError(400, f"{name} cannot be combined with tool_choice 'required' or a named function",
                           param=name)
    parallel = choice == "required" and req.parallel_tool_calls is not False
    try:
        calls = [parser.call_regex(t["function"]["name"], arguments_regex(t)) for t in chosen]
    except (ValueError, GrammarError) as e:
        raise APIError(400, str(e), param="tool_choice" if not isinstance(e, GrammarError) else "tools") from None
    regex = parser.calls_regex(calls, parallel)
    return ToolSetup(tools, set(names), with_reasoning(regex, reasoning))


def arguments_regex(tool: dict[str, Any]) -> str:
    """The regex of a tool's arguments object, laid out as json.dumps writes it."""
    schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
    return schema_to_regex(json.dumps(schema), None)   # None: the json.dumps layout


def with_reasoning(regex: str, reasoning: ReasoningParser | None) -> str:
    return regex if reasoning is None else reasoning.prefix_regex() + f"(?:{regex})"


def constrain_after_reasoning(params: dict[str, Any], req: Any, reasoning: ReasoningParser | None) -> None:
    """With a reasoning parser, a `response_format` constraint becomes a regex that starts after the
    reasoning block (mutates params). The low-level `regex` / `json_schema` extras stay as given: they
    constrain the whole output."""
    fmt = req.response_format
    if reasoning is None or fmt is None or fmt.type == "text":
        return
    if req.regex is not None or req.json_schema is not None or req.ebnf is not None:
        raise APIError(400, "response_format cannot be combined with regex, json_schema or ebnf",
                       param="response_format")
    try:
        inner = schema_to_regex(params.pop("json_schema"), DEFAULT_JSON_WHITESPACE_PATTERN)
    except GrammarError as e:
        raise APIError(400, str(e), param="response_format") from None
    params["regex"] = with_reasoning(inner, reasoning)


def output_parser(setup: ToolSetup, tool_parser: ToolCallParser | None, reasoning: ReasoningParser | None,
                  separate_reasoning: bool) -> ChatOutputParser | None:
    """The request's output parser, or None when the text goes out unchanged."""
    use_reasoning = reasoning if separate_reasoning else None
    use_tools = tool_parser if setup.parse_names is not None else None
    if use_reasoning is None and use_tools is None:
        return None
    return ChatOutputParser(use_reasoning, use_tools, setup.parse_names)
