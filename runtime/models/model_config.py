"""ModelConfig: what the runtime needs from an HF model folder, read from config.json directly.

A .gguf file path is accepted too: its metadata is converted once into a cached HF folder
(see gguf_loader.materialize_gguf) and `gguf_file` tells the weight loader where the weights are.

Accepts both config.json forms: transformers 5 (`rope_parameters`, `dtype`) and the older one
(top-level `rope_theta`, `rope_scaling`, `torch_dtype`). Every problem a user can cause (bad path,
unsupported architecture or rope, too long a context) raises `ModelLoadError` with a plain message;
so does any config.json value the runtime does not implement (see config_fields.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..layers.moe import MoEOptions
from ..layers.rotary import SUPPORTED_ROPE_TYPES
from .config_fields import moe_options, sliding_layers, unsupported_reason
from .registry import SUPPORTED_ARCHITECTURES

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


class ModelLoadError(ValueError):
    """A model cannot be used as asked; the message says why and what to change."""


@dataclass(frozen=True)
class ModelConfig:
    path: str                      # the local model folder (downloaded from the hub if needed)
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    context_len: int
    dtype: torch.dtype
    eos_token_ids: list[int]
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None      # HF rope parameters with "rope_type"; None for plain rope
    attention_bias: bool
    mlp_bias: bool
    hf_config: dict = field(repr=False)
    gguf_file: str | None = None   # weights come from this GGUF file instead of safetensors in `path`
    sliding_window: int | None = None         # HF's: keys a query sees, itself included, on the layers below
    sliding_window_layers: tuple[int, ...] = ()
    moe: MoEOptions | None = None             # mixture of experts (Qwen2-MoE, Qwen3-MoE, Mixtral)
    hidden_act: str = "silu"                  # the MLP's gated activation
    local_rope_theta: float | None = None     # Gemma 3: rope base of the sliding-window layers
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is this ** -0.5
    final_logit_softcapping: float | None = None  # logits = tanh(logits / cap) * cap
    attn_logit_softcapping: float | None = None   # Gemma 2: attention scores s = tanh(s / cap) * cap
    rotary_dim: int | None = None             # rope on the first rotary_dim lanes of each head (None: all)

    @staticmethod
    def from_path(path: str, dtype: str = "auto", context_length: int | None = None,
                  revision: str | None = None, device: str = "cpu",
                  overrides: dict | None = None) -> ModelConfig:
        """Reads `path`/config.json (resolving a hub id first if `path` is not a local folder), with
        the fields in `overrides` (--json-model-override-args) replacing the file's.

        For a .gguf file, reads the config converted from its metadata (written on first use).
        `device` ("cpu" or "cuda") only matters for `dtype="auto"` (see `resolve_dtype`)."""
        gguf_file = str(Path(path).expanduser().resolve()) if is_gguf_file(path) else None
        if gguf_file:
            from .gguf_loader import materialize_gguf

            folder = materialize_gguf(gguf_file)
        else:
            folder = resolve_model_path(path, revision)
        hf = _read_json(folder / "config.json")
        if hf is None:
            raise ModelLoadError(f"Model folder {str(folder)!r} has no config.json; is it a Hugging Face model folder?")
        if overrides:
            logger.info("config.json overridden by --json-model-override-args: %s", overrides)
            hf = {**hf, **overrides}
        try:
            arch = _check_architecture(hf)
            reason = unsupported_reason(arch, hf)
            if reason is not None:
                raise ModelLoadError(f"{reason} ({str(folder / 'config.json')!r})")
            config = ModelConfig._from_hf(str(folder), hf, arch, dtype, context_length, device)
        except KeyError as err:
            raise ModelLoadError(f"{str(folder / 'config.json')!r} lacks the field {err.args[0]!r}") from None
        except ModelLoadError:
            raise
        except (TypeError, ValueError) as err:      # an override of the wrong type, e.g. a string for a count
            given = f" with --json-model-override-args {overrides}" if overrides else ""
            raise ModelLoadError(f"{str(folder / 'config.json')!r}{given}: {err}") from None
        return dataclasses.replace(config, gguf_file=gguf_file) if gguf_file else config

    @staticmethod
    def _from_hf(folder: str, hf: dict, arch: str, dtype: str, context_length: int | None,
                 device: str = "cpu") -> ModelConfig:
        num_heads = int(hf["num_attention_heads"])
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        theta, scaling = _rope_settings(hf)
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        return ModelConfig(
            path=folder,
            architecture=arch,
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            num_layers=int(hf["num_hidden_layers"]),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            context_len=_context_len(context_length, max_pos),
            dtype=resolve_dtype(dtype, hf, device),
            eos_token_ids=_eos_token_ids(hf, _read_json(Path(folder) / "generation_config.json") or {}),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch == "Qwen2MoeForCausalLM"))),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hf_config=hf,
            sliding_window=int(hf["sliding_window"]) if sliding_layers(arch, hf) else None,
            sliding_window_layers=tuple(sliding_layers(arch, hf)),
            moe=moe_options(arch, hf),
            hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
            local_rope_theta=_local_rope_theta(hf),
            query_pre_attn_scalar=(float(hf["query_pre_attn_scalar"]) if hf.get("query_pre_attn_scalar") else None),
            final_logit_softcapping=(float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping")
                                     else None),
            attn_logit_softcapping=(float(hf["attn_logit_softcapping"]) if hf.get("attn_logit_softcapping")
                                    else None),
            rotary_dim=_rotary_dim(hf, head_dim),
        )

    def sliding_window_size(self, layer_id: int) -> int:
        """The layer's window as FlashInfer's `window_left` (a query at position i sees keys
        [i - window_left, i]); -1 for full attention."""
        if self.sliding_window is None or layer_id not in self.sliding_window_layers:
            return -1
        return self.sliding_window - 1

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each TP rank stores (kv heads are replicated when tp_size > num_kv_heads)."""
        return max(1, self.num_kv_heads // tp_size)

    def check_tp_size(self, tp_size: int) -> None:
        """Raises ModelLoadError unless the heads split evenly over `tp_size` ranks."""
        if self.num_heads % tp_size != 0:
            raise ModelLoadError(f"num_attention_heads ({self.num_heads}) is not divisible by tp size ({tp_size})")
        kv, tp = self.num_kv_heads, tp_size
        if (kv >= tp and kv % tp != 0) or (kv < tp and tp % kv != 0):
            raise ModelLoadError(f"num_key_value_heads ({kv}) and tp size ({tp}) must divide one another")


def resolve_model_path(path: str, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub id fetched with huggingface_hub (clear error offline)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise ModelLoadError(f"Model path {path!r} is a file; pass the model folder that holds config.json "
                             "(or a .gguf file)")
    if not _looks_like_hub_id(path):
        raise ModelLoadError(f"Model path {path!r} does not exist (and is not a Hugging Face Hub id)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=path, revision=revision, allow_patterns=HUB_FILE_PATTERNS))
    except Exception as err:  # network down, unknown repo, gated repo, offline mode, ...
        raise ModelLoadError(
            f"Model path {path!r} is not a local folder, and downloading it from the Hugging Face Hub failed "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no details'}). "
            "Check the path, or the network and HF_TOKEN for hub ids."
        ) from None


def is_gguf_file(path: str) -> bool:
    """True for an existing file named *.gguf."""
    return path.lower().endswith(".gguf") and Path(path).expanduser().is_file()


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return (not path.startswith((".", "/", "~")) and len(parts) <= 2 and all(parts)
            and os.sep not in path.replace("/", ""))


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{str(path)!r} is not valid JSON: {err}") from None


def _check_architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = ", ".join(archs) if archs else "none listed in config.json"
    raise ModelLoadError(f"Unsupported model architecture ({found}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope_settings(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from `rope_parameters` or `rope_theta`/`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "full_attention" in params:       # per layer type (Gemma 3): these are the full-attention layers'
        params = dict(params["full_attention"])
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":                # Phi-3's first name for LongRoPE (transformers renames it too)
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "longrope":
        _longrope_settings(hf, params)
    return theta, params


def _longrope_settings(hf: dict, params: dict) -> None:
    """Completes LongRoPE's parameters as transformers does: original_max_position_embeddings from
    the top-level field when there is one (Phi-3 keeps it there), else the rope dict's, else
    max_position_embeddings; `factor` defaults to max_position_embeddings / original (it sets the
    attention factor). Missing factor lists are refused."""
    missing = [k for k in ("short_factor", "long_factor") if not isinstance(params.get(k), list)]
    if missing:
        raise ModelLoadError(f"rope_type 'longrope' needs {' and '.join(missing)} (lists of numbers)")
    max_pos = int(hf.get("max_position_embeddings") or 2048)
    original = int(hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or max_pos)
    params["original_max_position_embeddings"] = original
    if params.get("factor") is None:
        params["factor"] = max_pos / original


def _rotary_dim(hf: dict, head_dim: int) -> int | None:
    """int(head_dim * partial_rotary_factor) (rope_parameters' value, else the top-level one, as
    transformers 5 reads it); None when the whole head rotates."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial == 1.0:
        return None
    dim = int(head_dim * partial)
    if not (0 < dim <= head_dim and dim % 2 == 0):
        raise ModelLoadError(f"partial_rotary_factor {partial} gives rotary_dim {dim} of head_dim {head_dim}; "
                             "it must be even and positive")
    return dim


def _local_rope_theta(hf: dict) -> float | None:
    """Gemma 3's rope base for sliding layers: rope_parameters["sliding_attention"] (transformers 5)
    or rope_local_base_freq (transformers 4); None when the layers share one rope."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention")
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"Unsupported rope_type {local.get('rope_type')!r} for the sliding layers")
        return float(local.get("rope_theta", 10000.0))
    return float(hf["rope_local_base_freq"]) if hf.get("rope_local_base_freq") else None


def _context_len(context_length: int | None, max_pos: int) -> int:
    if context_length is None:
        return max_pos
    if context_length <= 0:
        raise ModelLoadError(f"context_length must be positive, got {context_length}")
    if context_length > max_pos:
        raise ModelLoadError(f"context_length {context_length} is larger than the model's "
                             f"max_position_embeddings ({max_pos}); pass at most {max_pos}")
    return context_length


def resolve_dtype(dtype: str, hf: dict, device: str = "cpu") -> torch.dtype:
    """'auto' takes the checkpoint's dtype (float32 when config.json names none), except on CUDA,
    where a float32 checkpoint is served in bfloat16 (as SGLang serves it on GPUs, and what the
    FlashInfer kernels take); that choice is logged. An explicit dtype is taken as given."""
    if dtype == "auto":
        name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        name = str(name).removeprefix("torch.")
        if name not in DTYPES:
            raise ModelLoadError(f"config.json has dtype {name!r}; pass --dtype explicitly")
        if DTYPES[name] == torch.float32 and str(device).startswith("cuda"):
            logger.info("--dtype auto: the checkpoint is float32 (or names no dtype); serving it in "
                        "bfloat16 on CUDA (pass --dtype float32 to keep float32)")
            return torch.bfloat16
        return DTYPES[name]
    if dtype not in DTYPES:
        raise ModelLoadError(f"Unknown dtype {dtype!r}; choose from auto, bfloat16, float16, float32")
    return DTYPES[dtype]


def _eos_token_ids(hf: dict, generation: dict) -> list[int]:
    """eos ids from config.json then generation_config.json, deduplicated, in that order."""
    ids: list[int] = []
    for source in (hf.get("eos_token_id"), generation.get("eos_token_id")):
        for tid in source if isinstance(source, list) else [source]:
            if tid is not None and int(tid) not in ids:
                ids.append(int(tid))
    return ids
