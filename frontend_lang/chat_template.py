"""Chat templates for the DSL's roles: `system/user/assistant(...)` render as prefix + content + suffix.

A registry keyed by SGLang's template names (`default`, `chatml`, `qwen`, `llama-3-instruct`, with
`llama-3` as an alias). `detect_chat_template(model_info)` picks one for a server: first from the
tokenizer's own Jinja template when the tokenizer folder is readable from here (the tokenizer
path comes from `/get_model_info`), then from the model/tokenizer path name, else `default`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    default_system_prompt: str | None
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] = ()
    aliases: tuple[str, ...] = field(default=())

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        """The text around one message of `role` (the history is unused by the plain templates here)."""
        return self.role_prefix_and_suffix.get(role, ("", ""))

    def get_prompt(self, messages: list[dict]) -> str:
        """Renders a whole message list, the way the DSL's role calls render it piece by piece."""
        prompt = ""
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(message["role"], messages[:i])
            prompt += f"{prefix}{content}{suffix}"
        return prompt


chat_template_registry: dict[str, ChatTemplate] = {}
_matching_functions: list[Callable[[str], str | None]] = []


def register_chat_template(template: ChatTemplate) -> None:
    for name in (template.name, *template.aliases):
        chat_template_registry[name] = template


def register_chat_template_matching_function(func: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """`func(model_path) -> template name or None`; registered functions are tried in order."""
    _matching_functions.append(func)
    return func


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return chat_template_registry[name]
    except KeyError:
        known = ", ".join(sorted(chat_template_registry))
        raise ValueError(f"Unknown chat template {name!r}; known: {known}") from None


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    for func in _matching_functions:
        name = func(model_path)
        if name is not None:
            return get_chat_template(name)
    return get_chat_template("default")


def _chatml_roles() -> dict[str, tuple[str, str]]:
    return {role: (f"<|im_start|>{role}\n", "<|im_end|>\n") for role in ("system", "user", "assistant")}


register_chat_template(ChatTemplate(
    name="default",
    default_system_prompt=None,
    role_prefix_and_suffix={"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
))
register_chat_template(ChatTemplate(
    name="chatml", default_system_prompt=None, role_prefix_and_suffix=_chatml_roles(), stop_str=("<|im_end|>",),
))
register_chat_template(ChatTemplate(
    name="qwen", default_system_prompt="You are a helpful assistant.", role_prefix_and_suffix=_chatml_roles(),
    stop_str=("<|im_end|>",),
))
register_chat_template(ChatTemplate(
    name="llama-3-instruct",
    default_system_prompt=None,
    role_prefix_and_suffix={
        role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")
        for role in ("system", "user", "assistant")
    },
    stop_str=("<|eot_id|>",),
    aliases=("llama-3",),
))


@register_chat_template_matching_function
def _match_llama3(model_path: str) -> str | None:
    path = model_path.lower()
    if ("llama-3" in path or "llama3" in path) and "instruct" in path:
        return "llama-3-instruct"
    return None


@register_chat_template_matching_function
def _match_qwen(model_path: str) -> str | None:
    path = model_path.lower()
    if "qwen" in path and ("chat" in path or "instruct" in path):
        return "qwen"
    return None


@register_chat_template_matching_function
def _match_chatml(model_path: str) -> str | None:
    return "chatml" if "chatml" in model_path.lower() else None


# ------------------------------------------------------------- detection
def read_tokenizer_chat_template(tokenizer_path: str) -> str | None:
    """The Jinja chat template stored with a local tokenizer folder, if any."""
    jinja = os.path.join(tokenizer_path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    config = os.path.join(tokenizer_path, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None
    return None


def template_name_from_jinja(jinja: str) -> str | None:
    """Recognizes a template family by its special tokens."""
    if "<|start_header_id|>" in jinja and "<|eot_id|>" in jinja:
        return "llama-3-instruct"
    if "<|im_start|>" in jinja:
        return "qwen" if "You are a helpful assistant" in jinja else "chatml"
    return None


def detect_chat_template(model_info: dict) -> ChatTemplate:
    """Picks the template for a server from its `/get_model_info` answer."""
    if isinstance(model_info.get("chat_template"), str):  # a server that names its template
        name = model_info["chat_template"]
        if name in chat_template_registry:
            return chat_template_registry[name]
    paths = [p for p in (model_info.get("tokenizer_path"), model_info.get("model_path")) if isinstance(p, str)]
    for path in paths:
        try:
            jinja = read_tokenizer_chat_template(path) if os.path.isdir(path) else None
        except (OSError, ValueError):
            jinja = None
        name = template_name_from_jinja(jinja) if jinja else None
        if name is not None:
            return get_chat_template(name)
    for path in paths:
        template = get_chat_template_by_model_path(path)
        if template.name != "default":
            return template
    return get_chat_template("default")
