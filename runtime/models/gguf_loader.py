"""GGUF checkpoints (llama.cpp's single-file format): metadata to an HF folder, weights to HF tensors.

A .gguf file carries the config, the tokenizer and the chat template as metadata, and the weights
quantized (Q4_1, Q8_0, ...). Two pieces:

- `materialize_gguf(file)` writes config.json + tokenizer files + chat_template.jinja, converted by
  transformers from the metadata, into a cache folder keyed by the file's identity (name, size,
  mtime). Every process (tokenizer manager, scheduler, detokenizer) then reads that folder as a
  normal HF model folder. Done once per file; later calls only check the folder exists.
- `iterate_gguf_weights(file, num_heads, num_kv_heads)` dequantizes each tensor with the `gguf`
  package (fp32), renames it to its HF name, and undoes llama.cpp's q/k row permutation, so
  `load_weights` sees exactly what an HF safetensors checkpoint would hold. With
  `keep_quantized=True`, 2-D weights in a type runtime/layers/quant_linear.py keeps quantized
  (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) come as `GGUFQuantized` (the file's bytes, rows permuted the same
  way: a block covers 32 inputs of one row, so reordering rows is exact); runtime/models/gguf_quant.py
  attaches those to the layers.

The permutation: llama.cpp's converter reorders the rows of q_proj and k_proj within each head from
HF's rotate-half layout (first half / second half of head_dim) to interleaved pairs, because its
rope kernel rotates adjacent pairs. Per head it maps row `i*half + j` (i in {0,1}) to `2*j + i`;
the inverse reshapes to [heads, half, 2, in] and swaps the middle axes back (transformers' GGUF
loader does the same). Only the "llama" architecture is permuted this way.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .model_config import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = ("llama",)  # general.architecture values we load (Mistral files say "llama" too)
# transformers' model_type for the converted config -> HF architectures entry
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
META_VERSION = 1  # bump when the materialized folder's content changes

# GGUF tensor name piece -> HF name piece (per block: blk.N.<piece>.weight -> model.layers.N.<hf>.weight)
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def cache_root() -> Path:
    """radixlm's cache folder: $RADIXLM_CACHE_DIR, else ~/.cache/radixlm."""
    from ..env import CACHE_DIR

    return Path(CACHE_DIR.get() or Path.home() / ".cache" / "radixlm")


def gguf_architecture(gguf_file: str | Path) -> str:
    """The file's general.architecture; ModelLoadError if it is not a readable GGUF file."""
    try:
        from gguf import GGUFReader

        return str(GGUFReader(str(gguf_file)).fields["general.architecture"].contents())
    except (ValueError, KeyError, OSError) as err:
        raise ModelLoadError(f"{str(gguf_file)!r} is not a readable GGUF file ({err})") from None


def materialize_gguf(gguf_file: str | Path) -> Path:
    """The HF-style folder (config.json, tokenizer, chat template) for `gguf_file`, written on first use.

    Side effect: creates `<cache>/gguf/<stem>-<size>-<mtime_ns>-v<N>/` (atomically: a temp folder
    renamed into place, so concurrent callers are safe). Raises ModelLoadError for an unsupported
    architecture or an unreadable file.
    """
    path = Path(gguf_file).resolve()
    stat = path.stat()
    folder = cache_root() / "gguf" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{META_VERSION}"
    if (folder / "config.json").is_file():
        return folder
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    logger.info("Converting the metadata of %s (config, tokenizer, chat template) into %s", path.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        _write_hf_files(path, tmp)
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not a lost race with another process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _write_hf_files(path: Path, out: Path) -> None:
    """Writes config.json and the tokenizer files transformers converts from the GGUF metadata."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = config.to_dict()
    hf["architectures"] = [_HF_ARCHITECTURES.get(hf.get("model_type"), "LlamaForCausalLM")]
    hf["dtype"] = "bfloat16"  # dequantized weights have no native dtype; serve in bf16 unless --dtype says
    hf["gguf_file"] = str(path)
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))


def gguf_num_params(gguf_file: str | Path) -> int:
    """Parameters stored in the file (a tied lm head counted once, as it is stored once)."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(str(gguf_file)).tensors)


def hf_tensor_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for unknown names."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _BLOCK_RE.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, piece, suffix = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[piece]}.{suffix}"
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's per-head interleaving of q/k rows. weight: [num_heads*head_dim, in] (or bias)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@dataclass
class GGUFQuantized:
    """A weight kept in its GGUF type: `raw` holds the file's bytes, [rows, bytes per row] uint8."""

    raw: torch.Tensor
    qtype: int
    rows: int
    cols: int


def iterate_gguf_weights(gguf_file: str | Path, num_heads: int, num_kv_heads: int, show_progress: bool = True,
                         keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFQuantized]]:
    """Yields (HF name, fp32 CPU tensor) for every tensor of the file, dequantized one at a time
    (or, with `keep_quantized`, a GGUFQuantized for 2-D weights of the types kept quantized).

    Tensors without an HF counterpart (e.g. llama.cpp's rope_freqs) are logged and skipped.
    """
    from gguf import GGUFReader, dequantize

    from ..layers.quant_linear import QUANT_TYPES

    reader = GGUFReader(str(gguf_file))
    permute = str(reader.fields["general.architecture"].contents()) == "llama"
    for tensor in tqdm(reader.tensors, desc="Reading GGUF", unit="tensor", disable=not show_progress):
        name = hf_tensor_name(tensor.name)
        if name is None:
            logger.warning("Skipping GGUF tensor %s: no Hugging Face counterpart", tensor.name)
            continue
        if keep_quantized and int(tensor.tensor_type) in QUANT_TYPES and len(tensor.shape) == 2:
            cols, rows = (int(v) for v in tensor.shape)             # GGUF lists dims innermost first
            weight = torch.from_numpy(tensor.data.copy()).reshape(rows, -1)
            yield name, GGUFQuantized(_unpermuted(weight, name, permute, num_heads, num_kv_heads),
                                      int(tensor.tensor_type), rows, cols)
            continue
        # dequantize returns numpy in HF order ([out, in]); the reader's memory map is read-only
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        yield name, _unpermuted(weight, name, permute, num_heads, num_kv_heads)


def _unpermuted(weight: torch.Tensor, name: str, permute: bool, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """`weight` with llama.cpp's q/k row order undone for q_proj / k_proj (rows are the first dim)."""
    if permute and ".self_attn.q_proj." in name:
        return unpermute_qk(weight, num_heads)
    if permute and ".self_attn.k_proj." in name:
        return unpermute_qk(weight, num_kv_heads)
    return weight
