"""Checks on a GenerateReqInput's raw fields, run once, before any tokenization or scheduling.

    validate_generate_fields(obj, max_top_logprobs)   # rid, integer fields, top_logprobs_num, text
    check_logprob_start(start, prompt_len)            # once the prompt length is known
    input_size(obj)                                   # characters of text + token ids it carries
    check_extra_fields(extra)                         # /generate fields radixlm does not implement

Every problem is a ValueError whose message names the field and never echoes the offending value
(it may be huge, or not encodable: a lone surrogate cannot be written as UTF-8 JSON). Pure
functions; check_extra_fields also logs (debug) the names of fields it ignores.

SGLang's GenerateReqInput has many fields radixlm does not act on (radixlm implements text /
input_ids, sampling_params, rid, the logprob fields, stream, priority, timeout and session_params). Every other
field of SGLang's is accepted by `/generate`:

- METADATA_FIELDS are hints with no effect on the output (tracing, logging, routing labels): any
  value is accepted and ignored.
- Every field of UNSET_VALUES must be unset: null, false, an empty list/dict/string, or the listed
  default. Any other value asks for something radixlm cannot do (multimodal input, LoRA, hidden
  states, disaggregation, ...) and is refused with a 400 that names the field.
- Fields SGLang does not know either are ignored with a debug log, as SGLang does.
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

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


# ------------------------------------------------- SGLang fields radixlm does not implement
METADATA_FIELDS = frozenset({
    "session_id", "log_metrics", "routing_key", "conversation_id", "http_worker_ipc", "extra_key", "no_logs",
    "custom_labels", "external_trace_header", "received_time", "routed_experts_start_len",
    "disagg_prefill_dp_rank",
})

# field -> its "not requested" value besides null / false / empty
UNSET_VALUES: dict[str, Any] = {
    name: None for name in (
        "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
        "use_audio_in_video", "video_config", "watermark", "token_ids_logprob", "return_sampling_mask",
        "sampling_logprobs_mode", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_routed_experts",
        "return_indexer_topk", "modalities", "lora_path", "lora_id",
        "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port",
        "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "background", "require_reasoning",
        "max_thinking_tokens", "return_bytes", "return_entropy", "return_prompt_token_ids",
        "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
        "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
        "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt",
        "kv_hints")
}
UNSET_VALUES.update({"data_parallel_rank": 0, "routed_dp_rank": 0})


def _is_unset(value: Any, default: Any) -> bool:
    if value is None or value is False or value == default:
        return True
    if isinstance(value, (list, tuple)):                  # per-item lists of unset values
        return all(_is_unset(v, default) for v in value)
    return isinstance(value, (dict, str)) and not value


def check_extra_fields(extra: dict[str, Any]) -> None:
    """Validate the body fields radixlm does not implement; raises ValueError naming the field.

    Side effect: logs (debug) the names of fields unknown to SGLang too.
    """
    for name, value in extra.items():
        if name in METADATA_FIELDS:
            continue
        if name in UNSET_VALUES:
            if not _is_unset(value, UNSET_VALUES[name]):
                raise UnsupportedFieldError(name)
            continue
        logger.debug("ignoring unknown /generate field %r", name)


class UnsupportedFieldError(ValueError):
    def __init__(self, field: str) -> None:
        super().__init__(f"'{field}' is not supported by radixlm (only null / false / empty is accepted)")
        self.field = field
