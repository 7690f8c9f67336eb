"""Shared pieces for the agent tests: tool-capable chat templates (tests/data/*.jinja, written for
radixlm in the Qwen2.5/Hermes, Llama 3.1 and Mistral v3 styles), tools, and a 6-message agent trace."""

from __future__ import annotations

import copy
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
TEMPLATES = {"hermes": DATA / "hermes_tools.jinja", "llama3": DATA / "llama3_tools.jinja",
             "mistral": DATA / "mistral_tools.jinja"}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "enum": [1, 2, 3, 7]}},
        "required": ["city", "unit", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
                   "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def agent_trace(arguments_as_text: bool) -> list[dict]:
    """system, user, assistant with tool_calls, tool, assistant, user. OpenAI clients send the
    arguments as a JSON string; HF templates take them as an object."""
    args = {"city": "Paris", "unit": "celsius", "days": 2}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(args) if arguments_as_text else args}}
    return copy.deepcopy([
        {"role": "system", "content": "You are a travel agent."},
        {"role": "user", "content": "Will it rain in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"rain": false}'},
        {"role": "assistant", "content": "No rain is expected in Paris."},
        {"role": "user", "content": "And what time is it there?"},
    ])
