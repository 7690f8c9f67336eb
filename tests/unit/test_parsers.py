"""Tool-call and reasoning parsers on hand-written model outputs (runtime/parsers/).

Every case also checks the streaming contract: the parse of each prefix (cut at every character and,
for non-ASCII text, the parse through a byte-wise UTF-8 decoder) only grows towards the final parse,
and the deltas a stream sends add up to the non-streamed message.
"""

from __future__ import annotations

import codecs
import json
import re

import pytest

from radixlm.runtime.parsers import (
    ChatOutputParser,
    ChatStreamState,
    ToolCall,
    get_reasoning_parser,
    get_tool_call_parser,
)

ARGS = {"city": "Paris", "days": 3}
ARGS_JSON = json.dumps(ARGS)


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def stream_message(parser: ChatOutputParser, text: str, step: int = 1) -> dict:
    """Feeds text through a UTF-8 decoder byte by byte (step bytes at a time); joins the deltas."""
    state = ChatStreamState(parser)
    decoder = codecs.getincrementaldecoder("utf-8")()
    data = text.encode("utf-8")
    seen, acc = "", {"reasoning_content": "", "content": "", "tool_calls": []}
    for i in range(0, len(data), step):
        seen += decoder.decode(data[i:i + step])
        _merge(acc, state.delta(seen, final=False))
    _merge(acc, state.delta(seen, final=True))
    return acc


def _merge(acc: dict, delta: dict) -> None:
    for key in ("reasoning_content", "content"):
        acc[key] += delta.get(key, "")
    for call in delta.get("tool_calls", []):
        if "id" in call:      # a new call: index, id, type, name and the arguments so far
            assert call["index"] == len(acc["tool_calls"]) and call["type"] == "function"
            acc["tool_calls"].append(dict(call["function"]))
        else:                 # more arguments of a call already started
            assert set(call["function"]) == {"arguments"}
            acc["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]


def check_streaming(parser: ChatOutputParser, text: str) -> dict:
    """Asserts streamed == non-streamed for every split; returns the non-streamed message."""
    full = parser.parse(text, final=True)
    prev = parser.parse("", final=False)
    for cut in range(len(text) + 1):
        part = parser.parse(text[:cut], final=False)
        assert part.content.startswith(prev.content) and len(part.calls) >= len(prev.calls), (cut, prev, part)
        for have, grown in zip(prev.calls, part.calls):
            assert have.name == grown.name and grown.arguments.startswith(have.arguments), (cut, prev, part)
        prev = part
        assert full.content.startswith(part.content), (cut, part, full)
        assert (full.reasoning or "").startswith(part.reasoning or ""), (cut, part, full)
        assert len(part.calls) <= len(full.calls), (cut, part, full)
        for have, want in zip(part.calls, full.calls):
            assert have.name == want.name and want.arguments.startswith(have.arguments), (cut, part, full)
    for step in (1, 2, 3, 7):
        acc = stream_message(parser, text, step)
        assert acc["content"] == full.content
        assert acc["reasoning_content"] == (full.reasoning or "")
        assert acc["tool_calls"] == [{"name": c.name, "arguments": c.arguments} for c in full.calls]
    return {"content": full.content, "reasoning": full.reasoning, "calls": full.calls}


def tools(name: str, names: set[str] | None = None) -> ChatOutputParser:
    return ChatOutputParser(None, get_tool_call_parser(name), names)


# ---------------------------------------------------------------------- hermes / qwen25
@pytest.mark.parametrize("name", ["hermes", "qwen25"])
def test_hermes_single_parallel_and_text(name: str) -> None:
    p = tools(name, {"get_weather", "get_time"})
    out = check_streaming(p, hermes_call("get_weather", ARGS))
    assert out["content"] == "" and out["calls"] == [ToolCall("get_weather", ARGS_JSON)]
    text = "Let me check.\n" + hermes_call("get_weather", ARGS) + "\n" + hermes_call("get_time", {"tz": "CET"})
    out = check_streaming(p, text)
    assert out["content"] == "Let me check."
    assert [c.name for c in out["calls"]] == ["get_weather", "get_time"]
    assert json.loads(out["calls"][1].arguments) == {"tz": "CET"}
    out = check_streaming(p, "Héllo ✓ wörld <b>bold</b> <tool")   # a marker prefix at the end is content
    assert out["content"] == "Héllo ✓ wörld <b>bold</b> <tool" and not out["calls"]


def test_hermes_malformed_and_unknown_are_content() -> None:
    p = tools("hermes", {"get_weather"})
    bad = '<tool_call>\n{"name": get_weather, "arguments": {"city": "x"}}\n</tool_call>'
    out = check_streaming(p, "a " + bad + " b")
    assert out["content"] == "a " + bad + " b" and not out["calls"]
    unknown = hermes_call("rm_rf", {})
    assert check_streaming(p, unknown)["content"] == unknown
    truncated = '<tool_call>\n{"name": "get_weather", "argu'
    assert check_streaming(p, truncated)["content"] == truncated
    swapped = '<tool_call>{"arguments": {"city": "x"}, "name": "get_weather"}</tool_call>'
    assert check_streaming(p, swapped)["calls"] == [ToolCall("get_weather", '{"city": "x"}')]


def test_hermes_streams_arguments_and_keeps_a_call_broken_after_its_name() -> None:
    """Once `{"name": known, "arguments": {` is written the call stands (its arguments stream); bad
    JSON later cuts the arguments where it starts, and the rest of the block becomes content."""
    p = tools("hermes", {"get_weather"})
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": ]}\n</tool_call> after'
    out = check_streaming(p, broken)
    assert out["calls"] == [ToolCall("get_weather", '{"city": ')] and out["content"] == "]}\n after"
    cut = check_streaming(p, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert cut["calls"] == [ToolCall("get_weather", '{"city": "Par')]      # max_tokens hit mid-call
    text = hermes_call("get_weather", ARGS)
    state = ChatStreamState(p)
    fragments = [d["tool_calls"][0]["function"]["arguments"]
                 for k in range(len(text) + 1) if (d := state.delta(text[:k], final=k == len(text))).get("tool_calls")]
    assert len(fragments) > 5 and "".join(fragments) == ARGS_JSON    # arguments arrive as they grow


def test_hermes_arguments_as_json_string_and_unclosed_block() -> None:
    p = tools("hermes")
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}'   # no closing tag at the end
    assert check_streaming(p, text)["calls"] == [ToolCall("f", '{"x": [1, 2]}')]


# ---------------------------------------------------------------------- llama3
def test_llama3_json_calls() -> None:
    p = tools("llama3", {"get_weather", "get_time"})
    one = f'{{"name": "get_weather", "parameters": {ARGS_JSON}}}'
    assert check_streaming(p, one)["calls"] == [ToolCall("get_weather", ARGS_JSON)]
    two = one + '; {"name": "get_time", "parameters": {}}'
    assert [c.name for c in check_streaming(p, two)["calls"]] == ["get_weather", "get_time"]
    tagged = check_streaming(p, "Sure. <|python_tag|>" + one)
    assert tagged["content"] == "Sure." and len(tagged["calls"]) == 1
    assert check_streaming(p, '{"name": "get_weather", "parameters": {"a": ')["content"].startswith("{")
    assert check_streaming(p, "Just text {not a call}")["content"] == "Just text {not a call}"
    assert check_streaming(p, '{"title": "x"}')["content"] == '{"title": "x"}'


# ---------------------------------------------------------------------- mistral
def test_mistral_tool_calls() -> None:
    p = tools("mistral", {"get_weather", "get_time"})
    text = f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS_JSON}}}, {{"name": "get_time", "arguments": {{}}}}]'
    out = check_streaming(p, text)
    assert [c.name for c in out["calls"]] == ["get_weather", "get_time"] and out["content"] == ""
    out = check_streaming(p, "Checking. " + text)
    assert out["content"] == "Checking." and len(out["calls"]) == 2
    bad = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"'
    assert check_streaming(p, bad)["content"] == bad
    assert check_streaming(p, "[TOOL_CALL")["content"] == "[TOOL_CALL"


# ---------------------------------------------------------------------- pythonic
def test_pythonic_calls() -> None:
    p = tools("pythonic", {"get_weather", "get_time"})
    out = check_streaming(p, '[get_weather(city="Paris", days=3), get_time()]')
    assert out["calls"] == [ToolCall("get_weather", ARGS_JSON), ToolCall("get_time", "{}")]
    assert check_streaming(p, '[get_weather(city="a]b")]')["calls"][0].arguments == '{"city": "a]b"}'
    for text in ("[get_weather(city=Paris)]", "[get_weather(city='x'", "plain [list]", "[1, 2]", "[os.system('x')]"):
        assert check_streaming(p, text)["content"] == text


# ---------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
def test_reasoning_think_block(name: str) -> None:
    p = ChatOutputParser(get_reasoning_parser(name))
    out = check_streaming(p, "<think>a</think>b")
    assert (out["reasoning"], out["content"]) == ("a", "b")
    out = check_streaming(p, "<think>\nStep 1 < 2; </thin </think>\n\nThe answer is 4.")
    assert (out["reasoning"], out["content"]) == ("Step 1 < 2; </thin", "The answer is 4.")
    out = check_streaming(p, "<think>cut off by max_tokens")
    assert (out["reasoning"], out["content"]) == ("cut off by max_tokens", "")


def test_reasoning_without_opening_tag() -> None:
    r1 = ChatOutputParser(get_reasoning_parser("deepseek-r1"))
    out = check_streaming(r1, "a</think>b")
    assert (out["reasoning"], out["content"]) == ("a", "b")
    qwen3 = ChatOutputParser(get_reasoning_parser("qwen3"))
    out = check_streaming(qwen3, "no thinking here")
    assert (out["reasoning"], out["content"]) == ("", "no thinking here")


def test_reasoning_then_tool_call() -> None:
    p = ChatOutputParser(get_reasoning_parser("qwen3"), get_tool_call_parser("hermes"), {"get_weather"})
    out = check_streaming(p, "<think>I should call it</think>\n\n" + hermes_call("get_weather", ARGS))
    assert out["reasoning"] == "I should call it" and out["content"] == ""
    assert out["calls"] == [ToolCall("get_weather", ARGS_JSON)]
    msg = p.message("<think>x</think>" + hermes_call("get_weather", ARGS))
    assert msg["content"] is None and msg["reasoning_content"] == "x"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGS_JSON}
    assert msg["tool_calls"][0]["id"].startswith("call_")


def test_reasoning_prefix_regex() -> None:
    call = re.escape("CALL")
    for name, forced in (("qwen3", False), ("deepseek-r1", True)):
        regex = get_reasoning_parser(name).prefix_regex() + call
        assert re.fullmatch(regex, "<think>a < b </think\n</think>\n\nCALL")
        assert not re.fullmatch(regex, "<think>a</think>b</think>CALL")
        assert bool(re.fullmatch(regex, "CALL")) is (not forced)
        assert bool(re.fullmatch(regex, "thinking</think>CALL")) is forced


def test_unknown_parser_names() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_tool_call_parser("nope")
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
