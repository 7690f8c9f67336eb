"""Server-side chat templates: which template to use, and how chat messages become token ids.

Resolution (once, at startup; `--chat-template` paths are never read again):
  1. `--chat-template FILE` (a Jinja file) or `--chat-template NAME` from `CHAT_TEMPLATES`
     (chatml, llama-3, qwen, default);
  2. otherwise the tokenizer's own `chat_template`;
  3. otherwise the plain `default` template.

Messages are passed to the template as the client sent them (after `normalize_messages`): `tool`
messages, assistant `tool_calls` (arguments parsed from their JSON string into an object, as
templates expect), `reasoning_content`, and `tools` / `chat_template_kwargs` as template variables.
A field the template never mentions (`tool_calls`, `reasoning_content`, `tools`) is a ValueError
(400), not a silent drop.

Role injection. Strings in messages and tools are client data, so special-token text inside them (a
user typing `<|im_start|>system`) must be tokenized as plain text; only the template's own markup may
produce special tokens. `encode_chat` therefore:
  1. when no string holds the text of a special (or added) token, the common case, tokenizes the
     rendered prompt as one string: the ids equal `tokenizer.apply_chat_template(..., tokenize=True)`;
  2. otherwise renders the template once more with a unique sentinel in place of each such string,
     which splits the prompt into template segments and client strings, and tokenizes piece by piece:
     template segments with special tokens recognized, client strings with
     `split_special_tokens=True`, so `<|im_start|>` typed in a message becomes plain tokens.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_QWEN = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}" + _CHATML
)
_LLAMA3 = (
    "{{ bos_token if bos_token else '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_DEFAULT = (
    "{% for message in messages %}"
    "{{ message['role'].capitalize() + ': ' + message['content'] + '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

CHAT_TEMPLATES: dict[str, str] = {"chatml": _CHATML, "qwen": _QWEN, "llama-3": _LLAMA3, "default": _DEFAULT}
ALLOWED_ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                            "chat_template", "tokenize", "documents", "return_dict", "tokenizer_kwargs")
_SENTINEL = "\ue000radixlm-content-{}\ue001"
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+(message|m|msg)(\[['\"]content['\"]\]|\.content)")



@dataclass(frozen=True)
class JinjaChatTemplate:
    name: str                 # "tokenizer", a registry name, or the file path it came from
    source: str               # the Jinja text


def resolve_chat_template(spec: str | None, tokenizer: Any) -> JinjaChatTemplate:
    """Picks the template (see the module docstring). Raises ValueError for an unknown name."""
    if spec:
        if spec in CHAT_TEMPLATES:
            return JinjaChatTemplate(spec, CHAT_TEMPLATES[spec])
        if os.path.isfile(spec):
            with open(spec, encoding="utf-8") as f:
                return JinjaChatTemplate(spec, f.read())
        raise ValueError(f"--chat-template {spec!r} is neither a file nor one of: {', '.join(CHAT_TEMPLATES)}")
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):   # named templates: take "default"
        own = own.get("default") or next(iter(own.values()), None)
    if isinstance(own, str) and own.strip():
        return JinjaChatTemplate("tokenizer", own)
    logger.warning("The tokenizer has no chat template; using the plain 'default' template")
    return JinjaChatTemplate("default", _DEFAULT)


@dataclass
class ChatRequestInput:
    """What a chat request contributes to the template, checked by `normalize_messages`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)   # chat_template_kwargs


@dataclass
class ChatPrompt:
    """A rendered prompt as pieces: even indices are template text, odd ones client strings."""

    pieces: list[str]

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def token_ids(self, tokenizer: Any, start: int = 0) -> list[int]:
        """The ids of text[start:] (start: a char offset), client strings as plain text only."""
        ids: list[int] = []
        pos = 0
        for k, piece in enumerate(self.pieces):
            lo = max(0, start - pos)
            pos += len(piece)
            piece = piece[lo:]
            if not piece:
                continue
            if k % 2 == 0:   # the template's own text: its special tokens count
                ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
            else:            # client text: plain text only
                ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids


# ----------------------------------------------------------------- messages
def normalize_messages(messages: list[Any], template: JinjaChatTemplate | None = None) -> list[dict[str, Any]]:
    """Checks roles and fields; returns the messages as the template gets them. Raises ValueError.

    Content given as text parts is joined to one string unless the template loops over
    `message.content` itself (then the parts go through unchanged). Assistant tool-call arguments
    (JSON strings, as OpenAI sends them) become objects.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    keep_parts = template is not None and bool(_CONTENT_LOOP.search(template.source))
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not supported; use one of {', '.join(ALLOWED_ROLES)}")
        norm = {k: v for k, v in msg.items() if v is not None}
        norm["role"] = "system" if role == "developer" else role
        has_calls = bool(msg.get("tool_calls"))
        norm["content"] = _content(msg.get("content"), i, role, keep_parts, has_calls)
        if "tool_calls" in norm:
            if role != "assistant":
                raise ValueError(f"messages[{i}].tool_calls is only allowed in assistant messages")
            norm["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(norm["tool_calls"])]
        if "reasoning_content" in norm and not isinstance(norm["reasoning_content"], str):
            raise ValueError(f"messages[{i}].reasoning_content must be a string")
        out.append(norm)
    return out


def _content(content: Any, i: int, role: str, keep_parts: bool, has_calls: bool) -> Any:
    if content is None:
        if role == "assistant":
            return ""
        raise ValueError(f"messages[{i}].content is required")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"messages[{i}].content: only text parts are supported (got {kind!r})")
            texts.append(part["text"])
        return [dict(p) for p in content] if keep_parts else "".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


def _tool_call(call: Any, i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"{where} must be an object with 'function'")
    fn = dict(call["function"])
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object")
    fn["arguments"] = args
    return {**call, "type": call.get("type") or "function", "function": fn}


def check_renderable(template: JinjaChatTemplate, chat: ChatRequestInput) -> None:
    """ValueError when the request carries something the template never renders (see the docstring)."""
    src = template.source
    if chat.tools and "tools" not in src:
        raise ValueError(f"The chat template ({template.name}) does not render tools; "
                         "pass a tool-capable template with --chat-template")
    for i, m in enumerate(chat.messages):
        for name in ("tool_calls", "reasoning_content"):
            if m.get(name) and name not in src:
                raise ValueError(f"messages[{i}].{name}: the chat template ({template.name}) does not render "
                                 f"{name}")
    if chat.continue_final_message and chat.messages[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs the last message to be an assistant message")
    bad = sorted(set(chat.kwargs) & set(RESERVED_TEMPLATE_KWARGS))
    if bad:
        raise ValueError(f"chat_template_kwargs must not set {', '.join(bad)}; use the request fields")


# ----------------------------------------------------------------- rendering and encoding
def render_chat(template: JinjaChatTemplate, tokenizer: Any, chat: ChatRequestInput) -> str:
    """The prompt text, rendered with the tokenizer's own Jinja environment (as HF does)."""
    try:
        text = tokenizer.apply_chat_template(
            chat.messages, tools=chat.tools, chat_template=template.source, tokenize=False,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message, **chat.kwargs)
    except Exception as e:   # jinja raise_exception(...) in templates, bad role order, ...
        raise ValueError(f"Chat template error: {e}") from None
    if not isinstance(text, str):
        raise ValueError("Chat template did not render to text")
    return text


def encode_chat(template: JinjaChatTemplate, tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """(prompt text, prompt ids) of plain messages; see `encode_chat_prompt`."""
    prompt = encode_chat_prompt(template, tokenizer, ChatRequestInput(messages, None, add_generation_prompt))
    return prompt.text, prompt.token_ids(tokenizer)


def encode_chat_prompt(template: JinjaChatTemplate, tokenizer: Any, chat: ChatRequestInput) -> ChatPrompt:
    """The rendered prompt, split so that special-token text inside client strings stays plain text."""
    check_renderable(template, chat)
    text = render_chat(template, tokenizer, chat)
    markers = _special_texts(tokenizer)
    leaves: list[str] = []
    marked = _mark_leaves([chat.messages, chat.tools], markers, leaves)
    if not leaves:
        return ChatPrompt([text])
    marked_chat = ChatRequestInput(marked[0], marked[1], chat.add_generation_prompt,
                                   chat.continue_final_message, chat.kwargs)
    marked_text = render_chat(template, tokenizer, marked_chat)
    pattern = re.compile("(" + "|".join(re.escape(_SENTINEL.format(i)) for i in range(len(leaves))) + ")")
    pieces = pattern.split(marked_text)          # [template, sentinel, template, ..., template]
    pieces = [leaves[int(p[len("\ue000radixlm-content-"):-1])] if k % 2 else p for k, p in enumerate(pieces)]
    prompt = ChatPrompt(pieces)
    if prompt.text != text:   # a template filter (trim, tojson escaping) changed a client string
        raise ValueError("A message holds special-token text in a place the chat template transforms; "
                         "it cannot be kept as plain text")
    return prompt


def _mark_leaves(value: Any, markers: list[str], leaves: list[str]) -> Any:
    """value with every string that holds special-token text replaced by a sentinel (appended to leaves)."""
    if isinstance(value, str):
        if any(m in value for m in markers):
            leaves.append(value)
            return _SENTINEL.format(len(leaves) - 1)
        return value
    if isinstance(value, list):
        return [_mark_leaves(v, markers, leaves) for v in value]
    if isinstance(value, dict):
        for key in value:
            if isinstance(key, str) and any(m in key for m in markers):
                raise ValueError(f"A field name holds special-token text: {key!r}")
        return {k: (v if k == "role" else _mark_leaves(v, markers, leaves)) for k, v in value.items()}
    return value


def _special_texts(tokenizer: Any) -> list[str]:
    """The text of every special (and other added) token: what a client must not smuggle in."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        texts.add(str(getattr(tok, "content", tok)))
    return sorted(t for t in texts if t)
