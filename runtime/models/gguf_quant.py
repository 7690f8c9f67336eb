"""GGUF weights kept quantized: attaching `GGUFQuantized` tensors to the model's layers.

`load_model` passes the dense tensors of a GGUF file to `model.load_weights` as usual and the
quantized ones to `attach_quantized`, which builds one runtime/layers/quant_linear.QuantWeight per
layer (fused layers take their shards in the fused order: q, k, v and gate, up) and sets it as

- `packed_weight` of a linear layer or an untied LM head (linear() dispatches on it),
- `quant_weight` of the token embedding (rows dequantized on lookup); a tied LM head gets the same
  QuantWeight as its `packed_weight`, so the table is stored once, as the file has it.

The repacked bytes of all layers share one arena of 2 MiB pages. The layer's dense `weight`
parameter is then emptied to [0, in] (it was allocated but never written, so it held no memory). Used only with one TP rank on CPU (`keep_quantized`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..layers.quant_linear import packed_bytes, quant_weight
from ..layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ..mem_cache.huge_pages import huge_page_empty
from .gguf_loader import GGUFQuantized
from .llama import STACKED_PARAMS, remap_checkpoint_name
from .model_config import ModelLoadError

logger = logging.getLogger(__name__)


def keep_quantized(device: str | torch.device, tp_size: int, dequantize: bool | None = None) -> bool:
    """Whether a GGUF file's weights stay quantized: CPU, one TP rank, and not `dequantize`
    (None: --disable-gguf-quant / RADIXLM_DISABLE_GGUF_QUANT, and a CPU the quantized kernels run
    on). Logs why when they do not.

    Without the kernels (kernels/cpu_quant needs AVX512-VNNI) a quantized matmul dequantizes its
    whole weight on every call; on an AVX2 EPYC that made SmolLM2's decode step take seconds,
    while the dequantized bf16 weights in the gemm layout take milliseconds (3.5x the memory of
    Q4). An explicit `dequantize=False` keeps them quantized anyway."""
    from .. import env

    auto = dequantize is None
    dequantize = env.DISABLE_GGUF_QUANT.get() if dequantize is None else dequantize
    on_cpu = torch.device(device).type == "cpu"
    reason = ("--disable-gguf-quant" if dequantize else "tensor parallelism" if tp_size != 1
              else f"device {torch.device(device).type}" if not on_cpu
              else "this CPU has no AVX512-VNNI for the quantized kernels" if auto and not quant_kernels_run_here()
              else None)
    if reason is not None:
        logger.info("GGUF weights dequantized to the serving dtype (%s)", reason)
    return reason is None


def quant_kernels_run_here() -> bool:
    """kernels/cpu_quant builds for this CPU, or the CPU kernels are switched off (then nothing is
    fast, and the quantized weights at least keep the memory small)."""
    from .. import env
    from ...kernels.cpu_quant import cpu_supports_quant

    return cpu_supports_quant() or env.DISABLE_CPU_KERNELS.get()


def divert_quantized(weights: Iterable[tuple[str, object]], sink: list[tuple[str, GGUFQuantized]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the dense (name, tensor) pairs of `weights`; appends the GGUFQuantized ones to `sink`."""
    for name, tensor in weights:
        if isinstance(tensor, GGUFQuantized):
            sink.append((name, tensor))
        else:
            yield name, tensor


def _shard_order(param_name: str) -> list[object]:
    for fused, _ in STACKED_PARAMS.values():
        if f".{fused}." in param_name:
            return [sid for f, sid in STACKED_PARAMS.values() if f == fused]
    return [None]


def attach_quantized(model: nn.Module, items: list[tuple[str, GGUFQuantized]], tie_word_embeddings: bool) -> set[str]:
    """Sets each layer's QuantWeight (see the module docstring); returns the parameter names now loaded."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    shards: dict[str, dict[object, GGUFQuantized]] = {}
    for ckpt_name, tensor in items:
        if ckpt_name == "lm_head.weight" and tie_word_embeddings:
            continue
        name, shard_id = remap_checkpoint_name(ckpt_name)
        if name not in params:
            logger.warning("Skipping GGUF tensor %s: the model has no such parameter", ckpt_name)
            continue
        shards.setdefault(name, {})[shard_id] = tensor
    ordered: dict[str, list[GGUFQuantized]] = {}
    for name, got in shards.items():
        order = _shard_order(name)
        if set(got) != set(order):
            raise ModelLoadError(f"GGUF file has shards {sorted(map(str, got))} of {name}, needs {order}")
        ordered[name] = [got[sid] for sid in order]
    # every repacked weight in one arena of 2 MiB pages (as packed_linear.py does for bf16: 4 KiB
    # pages cost about half the read bandwidth on the project's VMs)
    sizes = [packed_bytes([(p.raw, p.qtype, p.rows) for p in parts], parts[0].cols) for parts in ordered.values()]
    arena = huge_page_empty(sum(sizes), torch.uint8) if sum(sizes) else None
    offset = 0

    def alloc(nbytes: int) -> torch.Tensor:
        nonlocal offset
        offset += nbytes
        return arena[offset - nbytes: offset]

    for name, parts in ordered.items():
        param, module = params[name], modules[name.rsplit(".", 1)[0]]
        weight = quant_weight([(p.raw, p.qtype, p.rows) for p in parts], parts[0].cols, alloc)
        if (weight.out_features, weight.in_features) != tuple(param.shape):
            raise ModelLoadError(f"{name}: GGUF shape {(weight.out_features, weight.in_features)}, "
                                 f"model {tuple(param.shape)}")
        param.data = param.data.new_empty((0, param.shape[1]))
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            module.quant_weight = weight
        else:
            module.packed_weight = weight
    for module in model.modules():   # a tied head scores with the embedding's table
        if isinstance(module, ParallelLMHead) and tie_word_embeddings and module.packed_weight is None:
            embed = next((m for m in model.modules() if getattr(m, "quant_weight", None) is not None
                          and m.weight is module.weight), None)
            if embed is not None:
                module.packed_weight = embed.quant_weight
    assert offset == sum(sizes)
    if ordered:
        from ..layers.quant_select import choose_quant_kernels

        weights = {id(m.packed_weight): m.packed_weight for m in model.modules()
                   if getattr(m, "packed_weight", None) is not None and hasattr(m.packed_weight, "parts")}
        choose_quant_kernels(list(weights.values()), next(model.parameters()).dtype)
    if shards:
        kinds = sorted({p.qtype for got in shards.values() for p in got.values()})
        logger.info("Kept %d GGUF weights quantized (ggml types %s, %.0f MiB)", len(shards), kinds,
                    sum(p.raw.numel() for got in shards.values() for p in got.values()) / 2**20)
    return set(shards)
