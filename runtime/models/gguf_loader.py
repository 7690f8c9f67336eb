"""GGUF checkpoints (llama.cpp's single-file format): metadata to an HF folder, weights to HF tensors.

A .gguf file carries the config, the tokenizer and the chat template as metadata, and the weights
quantized (Q4_1, Q8_0, ...). Two pieces:

- `materialize_gguf(file)` writes config.json (from the metadata, by gguf_config.py, which refuses
  what radixlm does not implement) + tokenizer files + chat_template.jinja (converted by
  transformers) into a cache folder keyed by the file's identity (name, size, mtime). Every process
  (tokenizer manager, scheduler, detokenizer) then reads that folder as a normal HF model folder.
  Done once per file; later calls only check the folder exists.
- `iterate_gguf_weights(file, num_heads, num_kv_heads)` dequantizes each tensor with the `gguf`
  package (fp32), renames it to its HF name and undoes what llama.cpp's converter changed, so
  `load_weights` sees what an HF safetensors checkpoint would hold (split where the file fuses
  what the model loads as parts). With `keep_quantized=True`, 2-D weights in a type
  runtime/layers/quant_linear.py keeps quantized (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
  come as `GGUFQuantized` (the file's bytes; a block covers 32 or 256 inputs of one row, so
  reordering, splitting or stacking rows is exact); runtime/models/gguf_quant.py attaches those.

What llama.cpp's converter changed, per architecture, and its undoing here:
- llama: the rows of q_proj and k_proj are reordered within each head from HF's rotate-half layout
  (first half / second half of head_dim) to interleaved pairs, because its rope kernel rotates
  adjacent pairs. Per head it maps row `i*half + j` (i in {0,1}) to `2*j + i`; the inverse reshapes
  to [heads, half, 2, in] and swaps the middle axes back. The other architectures use llama.cpp's
  NEOX rope (HF's layout) and are not permuted.
- gemma2, gemma3: RMSNorm weights are stored as w + 1 (the scale Gemma's norm applies): 1 is subtracted.
- qwen2moe / qwen3moe, and llama files with experts (Mixtral): the experts of a layer are one 3-D
  tensor per projection (ffn_gate_exps / ffn_up_exps / ffn_down_exps, [experts, out, in]): split into experts.{e}.*,
  quantized ones by rows (each expert stays in the file's type); the shared-expert gate is 1-D
  (made [1, hidden]). The routers stay dense (llama.cpp keeps them F32).
- phi3: attn_qkv and ffn_up hold the fused qkv_proj and gate_up_proj: split into q/k/v (rows
  heads*head_dim, kv_heads*head_dim twice) and gate/up (halves), quantized ones by rows too.
- olmo2: nothing to undo (its converter keeps HF's tensors; NEOX rope, so q/k are not permuted);
  only the names differ: post_attention_norm / post_ffw_norm are the post-attention / post-MLP norms.
  transformers cannot read olmo2 files, so its tokenizer conversion is called directly (the
  generic fast tokenizer class) for the tokenizer files.
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

from .gguf_config import ROPE_TENSORS, gguf_hf_config
from .model_config import ModelLoadError

logger = logging.getLogger(__name__)

META_VERSION = 2  # bump when the materialized folder's content changes

# GGUF tensor name piece -> HF name piece (per block: blk.N.<piece>.weight -> model.layers.N.<hf>.weight)
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",          # phi3: split on load
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",   # 3-D: split per expert on load
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_BLOCK_NAMES = {   # where an architecture's names differ from the table above
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    "phi3": {"ffn_up": "mlp.gate_up_proj"},   # the fused [gate | up]: split on load
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
# model types whose GGUF files transformers' loader refuses (no config mapping); radixlm converts the config itself
_NO_TRANSFORMERS_GGUF_CONFIG = ("olmo2",)
_DENSE_ONLY = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")   # plain nn.Linear, no packed weight
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
    hf = _hf_config(path)
    logger.info("Converting the metadata of %s (config, tokenizer, chat template) into %s", path.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        _write_hf_files(path, hf, tmp)
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not a lost race with another process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _hf_config(path: Path) -> dict:
    """The config dict converted from the file's metadata (gguf_config.py); ModelLoadError if unreadable."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, KeyError, OSError) as err:
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file ({err})") from None
    return gguf_hf_config(reader)


def _write_hf_files(path: Path, hf: dict, out: Path) -> None:
    """Writes config.json (`hf`) and the tokenizer files transformers converts from the GGUF metadata."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if hf["model_type"] in _NO_TRANSFORMERS_GGUF_CONFIG:
        # AutoTokenizer would first read the model config from the file and refuse the architecture;
        # the tokenizer conversion itself reads only tokenizer.ggml.*, so the generic fast class runs it
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = dict(hf)
    hf["dtype"] = "bfloat16"  # dequantized weights have no native dtype; serve in bf16 unless --dtype says
    hf["gguf_file"] = str(path)
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))


def gguf_num_params(gguf_file: str | Path) -> int:
    """Parameters stored in the file (a tied lm head counted once, as it is stored once)."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(str(gguf_file)).tensors)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for unknown names.
    Fused (phi3) and 3-D expert tensors get the name of the whole, split by `iterate_gguf_weights`."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _BLOCK_RE.match(gguf_name)
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    if match and match.group(2) in names:
        layer, piece, suffix = match.groups()
        return f"model.layers.{layer}.{names[piece]}.{suffix}"
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
    (or, with `keep_quantized`, a GGUFQuantized for 2-D weights and experts of the types kept
    quantized), converted back as the module docstring says.

    Tensors without an HF counterpart are logged and skipped (rope_freqs and Phi-3's
    rope_factors_long / rope_factors_short silently: gguf_config.py made them the config's rope).
    """
    from gguf import GGUFReader, dequantize

    from ..layers.quant_linear import QUANT_TYPES

    reader = GGUFReader(str(gguf_file))
    arch = str(reader.fields["general.architecture"].contents())
    for tensor in tqdm(reader.tensors, desc="Reading GGUF", unit="tensor", disable=not show_progress):
        name = hf_tensor_name(tensor.name, arch)
        if tensor.name in ROPE_TENSORS:
            continue
        if name is None:
            logger.warning("Skipping GGUF tensor %s: no Hugging Face counterpart", tensor.name)
            continue
        qtype, dims = int(tensor.tensor_type), [int(v) for v in tensor.shape]   # GGUF lists dims innermost first
        if (keep_quantized and qtype in QUANT_TYPES and len(dims) in (2, 3) and not name.endswith(_DENSE_ONLY)):
            # the file's bytes, rows first: [rows, bytes per row] or [experts, rows, bytes per row]
            raw = torch.from_numpy(tensor.data.copy()).reshape(*dims[:0:-1], -1)
            for hf_name, part in _converted(name, raw, arch, num_heads, num_kv_heads):
                yield hf_name, GGUFQuantized(part, qtype, part.shape[0], dims[0])
            continue
        # dequantize returns numpy in HF order ([out, in]); the reader's memory map is read-only
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        yield from _converted(name, weight, arch, num_heads, num_kv_heads)


def _converted(name: str, weight: torch.Tensor, arch: str, num_heads: int, num_kv_heads: int
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of one GGUF tensor. `weight` has rows first ([rows, ...], experts: [experts,
    rows, ...]); it is dense fp32, or quantized bytes (only row operations are applied to those)."""
    if ".mlp.experts." in name:                       # one tensor per projection -> one per expert
        layer, proj = name.split(".mlp.experts.")
        for e in range(weight.shape[0]):
            yield f"{layer}.mlp.experts.{e}.{proj}", weight[e]
        return
    if ".self_attn.qkv_proj." in name:                # phi3: rows [q | k | v]
        head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        for piece, part in zip(("q_proj", "k_proj", "v_proj"), weight.split(sizes), strict=True):
            yield name.replace("qkv_proj", piece), part
        return
    if ".mlp.gate_up_proj." in name:                  # phi3: rows [gate | up]
        gate, up = weight.chunk(2)
        yield name.replace("gate_up_proj", "gate_proj"), gate
        yield name.replace("gate_up_proj", "up_proj"), up
        return
    if arch == "llama" and ".self_attn.q_proj." in name:
        weight = unpermute_qk(weight, num_heads)
    elif arch == "llama" and ".self_attn.k_proj." in name:
        weight = unpermute_qk(weight, num_kv_heads)
    elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        weight = weight - 1.0                         # stored as the scale 1 + w
    elif name.endswith(".mlp.shared_expert_gate.weight") and weight.dim() == 1:
        weight = weight.reshape(1, -1)
    yield name, weight
