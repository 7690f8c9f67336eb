"""Cheap checks on a GenerateReqInput's raw fields, run before any tokenization or scheduling.

    validate_generate_fields(obj, max_top_logprobs)   # rid, integer fields, top_logprobs_num, text
    check_logprob_start(start, prompt_len)            # once the prompt length is known
    input_size(obj)                                   # characters of text + token ids it carries

Every problem is a ValueError whose message names the field and never echoes the offending value
(it may be huge, or not encodable: a lone surrogate cannot be written as UTF-8 JSON). Pure
functions, no side effects.
"""

from __future__ import annotations

import re
from typing import Any

MAX_RID_CHARS = 256
# sampling params that must be JSON integers (SamplingParams would accept 1000.0 for 1e3)
INT_SAMPLING_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed")
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _bad_unicode(text: str) -> bool:
    """Whether `text` holds a lone surrogate (not encodable as UTF-8). A C-speed check: a regex scan
    of a multi-megabyte prompt would hold the GIL for tens of milliseconds."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_rid(rid: Any) -> None:
    """A rid is a non-empty printable string of at most MAX_RID_CHARS, valid as UTF-8."""
    if rid is None:
        return
    if not isinstance(rid, str) or not rid:
        raise ValueError("rid must be a non-empty string")
    if len(rid) > MAX_RID_CHARS:
        raise ValueError(f"rid is longer than {MAX_RID_CHARS} characters")
    if _bad_unicode(rid) or _CONTROL.search(rid):
        raise ValueError("rid contains a lone surrogate or a control character")


def check_text(text: Any) -> None:
    """A prompt must be valid Unicode: a lone surrogate (e.g. JSON "\\ud800") cannot be tokenized."""
    for i, t in enumerate(_items(text)):
        if isinstance(t, str) and _bad_unicode(t):
            where = "" if isinstance(text, str) else f" (item {i})"
            raise ValueError(f"text{where} contains a lone surrogate (U+D800..U+DFFF), which is not valid "
                             "Unicode; send well-formed UTF-8")


def _has_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in a JSON-like value holds a lone surrogate."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _bad_unicode(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def validate_generate_fields(obj: Any, max_top_logprobs: int) -> None:
    """Checks rid(s), top_logprobs_num, logprob_start_len, integer sampling params and the text.
    Raises ValueError; reads only."""
    rids = obj.rid
    if isinstance(rids, list):
        for rid in rids:
            if rid is None:
                raise ValueError("rid must be a non-empty string")
            check_rid(rid)
    else:
        check_rid(rids)
    for top in _items(obj.top_logprobs_num):
        if top is not None and (not _is_int(top) or not 0 <= top <= max_top_logprobs):
            raise ValueError(f"top_logprobs_num must be an integer in [0, {max_top_logprobs}] "
                             "(--max-top-logprobs)")
    for start in _items(obj.logprob_start_len):
        if start is not None and (not _is_int(start) or start < -1):
            raise ValueError("logprob_start_len must be -1 (output only) or a prompt position >= 0")
    for params in _items(obj.sampling_params):
        if _has_surrogate(params):
            raise ValueError("sampling_params contains a lone surrogate (U+D800..U+DFFF), which is not "
                             "valid Unicode")
        if isinstance(params, dict):
            for name in INT_SAMPLING_FIELDS:
                value = params.get(name)
                if value is not None and not _is_int(value):
                    raise ValueError(f"{name} must be an integer")
    check_text(obj.text)


def check_logprob_start(start: int, prompt_len: int) -> None:
    """logprob_start_len must point inside the prompt (or be -1: output tokens only)."""
    if start >= prompt_len:
        raise ValueError(f"logprob_start_len ({start}) must be less than the prompt length "
                         f"({prompt_len} tokens), or -1 for output logprobs only")


def input_size(obj: Any) -> int:
    """Characters of text plus token ids in a request: what tokenizing and validating it cost."""
    size = 0
    for value in (obj.text, obj.input_ids):
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, list) and value and isinstance(value[0], (str, list)):
            size += sum(len(x) + 1 if isinstance(x, (str, list)) else 1 for x in value)
        elif isinstance(value, list):
            size += len(value)
    return size
