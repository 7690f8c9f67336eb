"""Server-side chat templates: which template to use, and how chat messages become token ids.

Resolution (once, at startup; `--chat-template` paths are never read again):
  1. `--chat-template FILE` (a Jinja file) or `--chat-template NAME` from `CHAT_TEMPLATES`
     (chatml, llama-3, qwen, default);
  2. otherwise the tokenizer's own `chat_template`;
  3. otherwise the plain `default` template.

Role injection. Message contents are client data, so special-token text inside them (a user typing
`<|im_start|>system`) must be tokenized as plain text; only the template's own markup may produce
special tokens. `encode_chat` therefore:
  1. when no content holds the text of a special (or added) token, the common case, tokenizes the
     rendered prompt as one string: the ids equal `tokenizer.apply_chat_template(..., tokenize=True)`;
  2. otherwise renders the template once more with a unique sentinel in place of each content, which
     splits the prompt into template segments and contents, and tokenizes piece by piece: template
     segments with special tokens recognized, contents with `split_special_tokens=True`, so
     `<|im_start|>` typed in a message becomes the plain tokens `<`, `|`, `im`, ... .
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
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
ALLOWED_ROLES = ("system", "developer", "user", "assistant")
_SENTINEL = "\ue000radixlm-content-{}\ue001"


@dataclass(frozen=True)
class ChatTemplate:
    name: str                 # "tokenizer", a registry name, or the file path it came from
    source: str               # the Jinja text


def resolve_chat_template(spec: str | None, tokenizer: Any) -> ChatTemplate:
    """Picks the template (see the module docstring). Raises ValueError for an unknown name."""
    if spec:
        if spec in CHAT_TEMPLATES:
            return ChatTemplate(spec, CHAT_TEMPLATES[spec])
        if os.path.isfile(spec):
            with open(spec, encoding="utf-8") as f:
                return ChatTemplate(spec, f.read())
        raise ValueError(f"--chat-template {spec!r} is neither a file nor one of: {', '.join(CHAT_TEMPLATES)}")
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):   # named templates: take "default"
        own = own.get("default") or next(iter(own.values()), None)
    if isinstance(own, str) and own.strip():
        return ChatTemplate("tokenizer", own)
    logger.warning("The tokenizer has no chat template; using the plain 'default' template")
    return ChatTemplate("default", _DEFAULT)


# ----------------------------------------------------------------- messages
def normalize_messages(messages: list[Any]) -> list[dict[str, str]]:
    """Checks roles and flattens content parts to text. Raises ValueError with a clear message."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ALLOWED_ROLES:
            raise ValueError(f"messages[{i}].role {role!r} is not supported; use one of {', '.join(ALLOWED_ROLES)}")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_text(msg.get("content"), i, role)})
    return out


def _content_text(content: Any, i: int, role: str) -> str:
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
        return "".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


# ----------------------------------------------------------------- rendering and encoding
def render_chat(template: ChatTemplate, tokenizer: Any, messages: list[dict[str, str]],
                add_generation_prompt: bool = True) -> str:
    """The prompt text, rendered with the tokenizer's own Jinja environment (as HF does)."""
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template.source, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:   # jinja raise_exception(...) in templates, bad role order, ...
        raise ValueError(f"Chat template error: {e}") from None
    if not isinstance(text, str):
        raise ValueError("Chat template did not render to text")
    return text


def encode_chat(template: ChatTemplate, tokenizer: Any, messages: list[dict[str, str]],
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """(prompt text, prompt ids) with special-token text inside contents kept as plain text."""
    text = render_chat(template, tokenizer, messages, add_generation_prompt)
    markers = _special_texts(tokenizer)
    if not any(marker in m["content"] for m in messages for marker in markers):
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    segments = _split_segments(template, tokenizer, messages, add_generation_prompt)
    return "".join(segments), _encode_segments(tokenizer, segments)


def _split_segments(template: ChatTemplate, tokenizer: Any, messages: list[dict[str, str]],
                    add_generation_prompt: bool) -> list[str]:
    """The prompt as alternating [template, content, template, ..., template] segments.

    Rendered with a sentinel in place of each content, then the sentinels are replaced by the
    contents as given (a template filter applied to a content, such as `trim`, is not replayed).
    """
    marked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    marked_text = render_chat(template, tokenizer, marked, add_generation_prompt)
    pattern = re.compile("(" + "|".join(re.escape(_SENTINEL.format(i)) for i in range(len(messages))) + ")")
    contents = {_SENTINEL.format(i): m["content"] for i, m in enumerate(messages)}
    pieces = pattern.split(marked_text)          # [template, sentinel, template, ..., template]
    return [contents[p] if k % 2 else p for k, p in enumerate(pieces)]


def _encode_segments(tokenizer: Any, segments: list[str]) -> list[int]:
    ids: list[int] = []
    for k, seg in enumerate(segments):
        if not seg:
            continue
        if k % 2 == 0:   # the template's own text: its special tokens count
            ids += tokenizer(seg, add_special_tokens=False)["input_ids"]
        else:            # message content: plain text only
            ids += tokenizer(seg, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def _special_texts(tokenizer: Any) -> list[str]:
    """The text of every special (and other added) token: what a client must not smuggle in."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        texts.add(str(getattr(tok, "content", tok)))
    return sorted(t for t in texts if t)
