"""Every config field of every registered architecture is either implemented or reviewed as inert.

Walks the transformers config class of each architecture in the registry: each of its fields must
be in READ_FIELDS or INERT_FIELDS (runtime/models/config_fields.py), not both. Then, for every READ
field, changing its value in a config.json must change the loaded ModelConfig or be refused with
ModelLoadError: a field listed as read but silently ignored fails here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import transformers

from radixlm.runtime.models.config_fields import INERT_FIELDS, READ_FIELDS
from radixlm.runtime.models.model_config import ModelConfig, ModelLoadError
from radixlm.runtime.models.registry import SUPPORTED_ARCHITECTURES

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=100, max_position_embeddings=256, eos_token_id=2)


def config_class(arch: str) -> type:
    return getattr(transformers, arch).config_class


def class_fields(arch: str) -> list[str]:
    return sorted(config_class(arch)().to_dict())


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_every_config_field_is_read_or_reviewed(arch: str) -> None:
    unknown = [f for f in class_fields(arch) if f not in READ_FIELDS and f not in INERT_FIELDS]
    assert not unknown, f"{arch}: fields neither implemented nor reviewed as inert: {unknown}"


def test_read_and_inert_lists_are_disjoint_and_explained() -> None:
    assert not set(READ_FIELDS) & set(INERT_FIELDS)
    assert all(why.strip() for why in (*READ_FIELDS.values(), *INERT_FIELDS.values()))


def base_config(arch: str) -> dict:
    hf = config_class(arch)(**SMALL).to_dict()
    hf.update(architectures=[arch], dtype="float32", hidden_act="silu")
    if "sliding_window" in hf:
        hf["sliding_window"] = None
    return hf


def _window_context(arch: str, field: str) -> dict:
    """A config in which `field` decides whether a layer slides (Qwen's switches only matter
    together: a window, the switch on, and max_window_layers below the layer count)."""
    hf = base_config(arch)
    if field == "original_max_position_embeddings":    # read with LongRoPE only (as in transformers)
        dims = SMALL["hidden_size"] // SMALL["num_attention_heads"] // 2
        hf["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * dims,
                                 "long_factor": [2.0] * dims}
        return hf
    if arch == "Gemma3ForCausalLM" and field in ("sliding_window", "layer_types", "_sliding_window_pattern"):
        hf["sliding_window"] = None if field == "sliding_window" else 48
        if field != "layer_types":
            hf.pop("layer_types", None)
        return hf
    if arch == "MistralForCausalLM" or field not in ("sliding_window", "use_sliding_window",
                                                     "max_window_layers", "layer_types"):
        return hf
    hf.update(sliding_window=48, use_sliding_window=True, max_window_layers=1)
    if field != "layer_types":
        hf.pop("layer_types", None)
    if field == "sliding_window":
        hf["sliding_window"] = None
    if field == "use_sliding_window":
        hf["use_sliding_window"] = False
    if field == "max_window_layers":
        hf["max_window_layers"] = SMALL["num_hidden_layers"]
    return hf


def perturbed(field: str, value: object) -> object:
    if field == "sliding_window":
        return 48 if value is None else None
    if field == "max_window_layers":
        return 0
    if field == "_sliding_window_pattern":
        return 2
    if field == "mlp_only_layers":
        return [0]
    if field == "layer_types":
        flipped = "full_attention" if value[0] == "sliding_attention" else "sliding_attention"
        return [flipped, *value[1:]]
    if field == "rope_parameters" and "full_attention" in value:     # per layer type (Gemma 3)
        return {**value, "sliding_attention": perturbed(field, value["sliding_attention"])}
    if field == "rope_parameters":
        return {**value, "rope_theta": value["rope_theta"] * 2}
    if field == "head_dim" and value is None:
        return 32
    if value is None:                                  # an unset option: set it
        return True if field.startswith("use_") else 30.0
    if field == "dtype":
        return "bfloat16"
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [f"{value[0]}-other"]
    raise AssertionError(f"no perturbation for {field}={value!r}")


def load(tmp_path: Path, name: str, hf: dict) -> ModelConfig | str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    try:
        config = ModelConfig.from_path(str(folder))
    except ModelLoadError as err:
        return f"refused: {err}"
    return dataclasses.replace(config, path="", hf_config={})


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_every_read_field_changes_the_loaded_config(arch: str, tmp_path: Path) -> None:
    for field in [f for f in class_fields(arch) if f in READ_FIELDS]:
        hf = _window_context(arch, field)
        before = load(tmp_path, f"{field}-a", hf)
        assert isinstance(before, ModelConfig), f"{arch} {field}: base config refused: {before}"
        changed = copy.deepcopy(hf)
        changed[field] = perturbed(field, hf[field])
        after = load(tmp_path, f"{field}-b", changed)
        assert after != before, f"{arch}: changing {field} to {changed[field]!r} changed nothing"


@pytest.mark.parametrize("hf_patch, message", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"is_encoder_decoder": True}, "Encoder-decoder"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "short_factor and long_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
])
def test_unimplemented_values_are_refused(tmp_path: Path, hf_patch: dict, message: str) -> None:
    hf = {**base_config("LlamaForCausalLM"), **hf_patch}
    result = load(tmp_path, "m", hf)
    assert isinstance(result, str) and message in result


def test_windows_follow_transformers_rules(tmp_path: Path) -> None:
    """Qwen2's window is off unless use_sliding_window (real Qwen2.5 configs carry a window value
    with the switch off); Llama has no window field, so transformers ignores one."""
    qwen = {**base_config("Qwen2ForCausalLM"), "sliding_window": 32768, "use_sliding_window": False}
    assert isinstance(load(tmp_path, "qwen", qwen), ModelConfig)
    llama = {**base_config("LlamaForCausalLM"), "sliding_window": 48}
    assert isinstance(load(tmp_path, "llama", llama), ModelConfig)
