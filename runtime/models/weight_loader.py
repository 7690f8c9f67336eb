"""Reads safetensors checkpoints (single file or sharded with an index) or a GGUF file, and builds
loaded models.

Tensors are read one at a time from memory-mapped files, so loading never holds the whole
checkpoint; each parameter's `weight_loader` keeps only this TP rank's slice.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from ..distributed.parallel_state import get_tp_rank, get_tp_size
from .model_config import ModelConfig, ModelLoadError
from .registry import get_model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint files: those named by the index file if present, else every *.safetensors."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{INDEX_FILE} in {str(folder)!r} names missing files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No *.safetensors weights in {str(folder)!r} (only safetensors checkpoints load)")
    return files


def iterate_weights(folder: str | Path, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (checkpoint name, CPU tensor) for every tensor, file by file, with a progress bar."""
    files = safetensors_files(folder)
    bar = tqdm(files, desc="Loading safetensors", unit="file", disable=not show_progress)
    for path in bar:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_weights(config: ModelConfig, show_progress: bool = True,
                       keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) pairs from the config's GGUF file if it has one, else its safetensors.
    With `keep_quantized`, a GGUF file's quantized weights come as GGUFQuantized (gguf_loader.py)."""
    if config.gguf_file:
        from .gguf_loader import iterate_gguf_weights

        weights = iterate_gguf_weights(config.gguf_file, config.num_heads, config.num_kv_heads, show_progress,
                                       keep_quantized=keep_quantized)
    else:
        weights = iterate_weights(config.path, show_progress=show_progress)
    return _first_layers(weights, config.num_layers)


def _first_layers(weights: Iterator[tuple[str, torch.Tensor]], num_layers: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Drops the tensors of layers >= num_layers (a checkpoint cut short by --json-model-override-args
    '{"num_hidden_layers": N}'), with one log line saying how many."""
    dropped: set[int] = set()
    for name, tensor in weights:
        match = LAYER_NAME.match(name)
        if match and int(match.group(1)) >= num_layers:
            dropped.add(int(match.group(1)))
            continue
        yield name, tensor
    if dropped:
        logger.info("Skipped the checkpoint's layers %d-%d: the model has %d layers", min(dropped), max(dropped),
                    num_layers)


def load_model(config: ModelConfig, device: str | torch.device = "cpu", show_progress: bool | None = None,
               disable_gguf_quant: bool | None = None) -> nn.Module:
    """Builds the model for `config` in `config.dtype` on `device` and loads its weights.

    A GGUF file's quantized weights stay quantized (gguf_quant.py) unless `disable_gguf_quant`
    (default: --disable-gguf-quant / RADIXLM_DISABLE_GGUF_QUANT, and a CPU without the quantized
    kernels: see keep_quantized) or the device / TP size rule it out.

    Raises ModelLoadError when the heads do not split over the TP size or a parameter gets no weight.
    The progress bar shows on TP rank 0 only (unless `show_progress` says otherwise).
    """
    config.check_tp_size(get_tp_size())
    model = build_model(config, device)
    progress = get_tp_rank() == 0 if show_progress is None else show_progress
    if config.gguf_file:
        from .gguf_quant import attach_quantized, divert_quantized, keep_quantized

        quantized: list = []
        weights = checkpoint_weights(config, progress, keep_quantized(device, get_tp_size(), disable_gguf_quant))
        loaded = model.load_weights(divert_quantized(weights, quantized))
        loaded |= attach_quantized(model, quantized, config.tie_word_embeddings)
    else:
        loaded = model.load_weights(checkpoint_weights(config, show_progress=progress))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"Checkpoint in {config.gguf_file or config.path!r} lacks weights for: {shown}")
    return model.eval()


def build_model(config: ModelConfig, device: str | torch.device) -> nn.Module:
    """Instantiates the architecture's class with parameters in `config.dtype` on `device`
    (parameter values are uninitialized until weights are loaded)."""
    model_class = get_model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    return model
