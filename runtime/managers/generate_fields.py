"""SGLang's `GenerateReqInput` fields that radixlm does not act on, and what a request may set them to.

radixlm implements text/input_ids, sampling_params, rid, the logprob fields, stream, priority and
timeout (see io_struct.GenerateReqInput). Every other field of SGLang's GenerateReqInput is accepted:

- METADATA_FIELDS are hints with no effect on the output (tracing, logging, routing labels): any
  value is accepted and ignored.
- Every field of UNSET_VALUES must be unset: null, false, an empty list/dict/string, or the listed
  default. Any other value asks for something radixlm cannot do (multimodal input, LoRA, hidden
  states, disaggregation, ...) and is refused with a 400 that names the field.
- Fields SGLang does not know either are ignored with a debug log, as SGLang does.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

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
        "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
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
