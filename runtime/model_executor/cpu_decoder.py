"""CpuDecoder: a CPU decode step's decoder layers in one C++ call (kernels/cpu_decoder).

    decoder = CpuDecoder.create(model, kv_cache, attn_backend, tp_size)   # None if it does not apply
    hidden = decoder(fb)              # a DECODE batch: final-normed hidden [bs, hidden]

The Python forward of runtime/models/llama.py calls about ten small ops per layer, each through a
module call and torch's Python bindings. At batch 1 on a small model those calls cost as much as
the matmuls (SmolLM2-135M: about 5 ms of a 15 ms step). The C++ decoder runs the same kernels in
the same order with the same arguments, so its output equals the Python forward's to the bit
(tests/unit/test_cpu_decoder.py); it only drops the per-op Python work. This is radixlm's CPU
counterpart of SGLang's decode CUDA graphs.

Prefill, extend and mixed passes take the same layer loop (`extend`), with each layer's attention
called per run of like requests exactly as the attention backend calls it (decode, the AVX512/AVX2
extend or the brgemm extend kernel, torch_native.py). At 2,048 prefill tokens the Python calls are
noise, but a single 320-token prompt (TTFT at concurrency 1) paid for them. Not with GGUF weights
kept quantized: their prefill kernel is chosen per row count (quant_select.py), so those passes keep
the Python forward. `--disable-cpu-decoder` turns both off.

A decode step of dense layers with bf16 weights in the gemm layout may run split between the threads
(`Decoder.forward_split`: each thread takes its run of requests through every layer alone, same
bits), where timing says that is faster (decode_split.py; `--cpu-decode-split`).

It applies to Llama-family models (Llama, Qwen2, Qwen3, and the MoE ones: Qwen2-MoE, Qwen3-MoE,
Mixtral) on CPU with one tensor-parallel rank, in fp32 or bf16, when the fused ops and the
attention kernels are loaded and torch.compile is off;
linear weights may be plain, in the bf16 gemm layout, in oneDNN's packed layout, or GGUF
weights kept quantized in kernels/cpu_quant's layout (a fused layer may mix GGUF types, as Q4_K_M's
qkv does: its parts run one after the other and their outputs are joined, as quant_linear.py does).
A sparse (MoE) layer runs SparseMoeBlock's fused path in C++ (router, fp32 softmax, top-k, the
kernels/cpu_moe experts, the gated shared expert), so it needs bf16 experts in the gemm layout.
`create` logs why not otherwise, and the Python forward runs.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ...kernels import cpu_ops
from ...kernels.cpu_decoder import load_cpu_decoder
from .. import env
from ..layers.attention import extend_select
from ..layers.moe import SparseMoeBlock
from ..layers.packed_linear import GemmWeight
from ..layers.quant_linear import QuantWeight
from .decode_split import SplitChoice
from .forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16)


class CpuDecoder:
    def __init__(self, mod: object, impl: object, embed: nn.Module, attn_kernels: object, first_attn: nn.Module,
                 dtype: torch.dtype, takes_extend: bool, split: SplitChoice):
        self.mod = mod              # the extension module (its ExtendRun)
        self.split = split          # whole or split decode steps (decode_split.py)
        self.impl = impl            # the extension's Decoder (holds the weights and K/V buffers)
        self.embed = embed
        # what extend_select.kernel_for needs to pick each extend run's kernel as the Python forward does
        self.attn_kernels, self.first_attn, self.dtype = attn_kernels, first_attn, dtype
        self.takes_extend = takes_extend    # False for GGUF weights (see create)

    @classmethod
    def create(cls, model: nn.Module, kv_cache: object, attn_backend: object, tp_size: int) -> CpuDecoder | None:
        """The decoder for `model`, or None (logged) when this model or setting cannot use it.
        Side effects: may build the extension (logged); holds references to the weights and K/V buffers."""
        reason = _unsupported_reason(model, kv_cache, attn_backend, tp_size)
        if reason is None and load_cpu_decoder() is None:
            reason = "the C++ extension is disabled or did not build"
        if reason is not None:
            logger.info("One-call CPU decoder off (%s); decode runs the Python forward", reason)
            return None
        inner = model.model
        first = inner.layers[0].self_attn
        rotary = first.rotary_emb
        mod = load_cpu_decoder()
        impl = mod.Decoder(first.attn.num_heads, first.attn.num_kv_heads, first.head_dim,
                                          inner.norm.eps, first.attn.scaling, rotary.cos_cache, rotary.sin_cache,
                                          inner.norm.weight.detach())
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            common = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                      None if attn.q_norm is None else attn.q_norm.weight.detach(),
                      None if attn.k_norm is None else attn.k_norm.weight.detach(),
                      _linear_args(attn.qkv_proj), _linear_args(attn.o_proj))
            if isinstance(mlp, SparseMoeBlock):
                impl.add_moe_layer(*common, _moe_args(mlp), kv_cache.k_buffer[i], kv_cache.v_buffer[i])
            else:
                impl.add_layer(*common, _linear_args(mlp.gate_up_proj), _linear_args(mlp.down_proj),
                               kv_cache.k_buffer[i], kv_cache.v_buffer[i])
        # GGUF weights: at prefill quant_select.py picks a kernel per row count (vnni, gemm or dequant
        # through oneDNN), where decoder.cpp always runs vnni; those passes keep the Python forward
        linears = [linear for layer in inner.layers for linear in _layer_linears(layer)]
        takes_extend = not any(isinstance(linear.packed_weight, QuantWeight) for linear in linears)
        # Split decode steps were measured with radixlm's bf16 gemm on dense layers only
        dense_gemm = not any(isinstance(layer.mlp, SparseMoeBlock) for layer in inner.layers) and all(
            isinstance(linear.packed_weight, GemmWeight) for linear in linears)
        split = SplitChoice(env.CPU_DECODE_SPLIT.get() if dense_gemm else "off")
        logger.info("One-call CPU decoder on: %s run the %d decoder layers in one C++ call; decode steps split "
                    "between the threads: %s", "decode and prefill steps" if takes_extend else
                    "decode steps (prefill: GGUF weights, Python)", impl.num_layers,
                    {"auto": "where timing says it is faster", "on": "always (--cpu-decode-split on)",
                     "off": "no" if dense_gemm else "no (not bf16 gemm-layout dense layers)"}[split.mode])
        return cls(mod, impl, inner.embed_tokens, attn_backend.kernels, first.attn, inner.norm.weight.dtype,
                   takes_extend, split)

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        """hidden [bs, hidden] for a DECODE batch; writes every layer's K/V at fb.out_cache_loc."""
        run = fb.attn_metadata.runs[0]   # torch_native's kernel metadata: a decode pass is one run (int64)
        bs = run.seq_lens.numel()
        parts, key = self.split.parts_for(torch.get_num_threads(), bs, int(run.seq_lens.sum()) / max(bs, 1))
        args = (self.embed(fb.input_ids), fb.positions, fb.out_cache_loc, fb.req_to_token_pool.req_to_token,
                run.req_pool_indices, run.seq_lens)
        t0 = time.perf_counter()
        hidden = self.impl.forward(*args) if parts == 1 else self.impl.forward_split(*args, parts)
        self.split.record(key, parts, time.perf_counter() - t0)
        return hidden

    def extend(self, fb: ForwardBatch) -> torch.Tensor:
        """hidden [num_tokens, hidden] (the rows fb.output_rows only, when set) for a prefill, extend or
        mixed pass; writes every layer's K/V at fb.out_cache_loc. Each run of the backend's kernel
        metadata gets the kernel the Python forward would give it (decided here, before the first
        layer, as the backend decides at its first)."""
        runs = []
        for run in fb.attn_metadata.runs:
            if run.kernel is None:
                run.kernel = extend_select.kernel_for(self.attn_kernels, self.first_attn, run.kind, self.dtype,
                                                      self.dtype)
            runs.append(self.mod.ExtendRun(EXTEND_KERNELS[run.kernel], run.q0, run.q1, run.req_pool_indices,
                                           run.seq_lens, run.prefix_lens, run.qo_indptr))
        return self.impl.extend(self.embed(fb.input_ids), fb.positions, fb.out_cache_loc,
                                fb.req_to_token_pool.req_to_token, runs, fb.output_rows)


EXTEND_KERNELS = {"decode": 0, "simd": 1, "brgemm": 2}   # decoder.cpp's ExtendRun.kernel
DENSE, GEMM, ONEDNN = 0, 1, 2       # the weight layouts decoder.cpp takes (packed_linear.py makes them)
QUANT_PARTS = 3                     # a QuantWeight of several parts: [(packed, ggml type, rows)]
QUANT_BASE = 100                    # + a ggml type: kernels/cpu_quant's layout (quant_linear.py)


def _linear_args(layer: nn.Module) -> tuple:
    packed = layer.packed_weight
    bias = None if layer.bias is None else layer.bias.detach()
    if isinstance(packed, GemmWeight):
        return packed.data, bias, packed.out_features, GEMM, []
    if isinstance(packed, QuantWeight) and len(packed.parts) == 1:   # repacked (checked before)
        return packed.parts[0].data, bias, packed.out_features, QUANT_BASE + packed.parts[0].qtype, []
    if isinstance(packed, QuantWeight):
        parts = [(p.data, p.qtype, p.rows) for p in packed.parts]
        return parts[0][0], bias, packed.out_features, QUANT_PARTS, parts
    if packed is not None:
        return packed, bias, packed.shape[0], ONEDNN, []       # an opaque oneDNN tensor, [out, in] sizes
    return layer.weight.detach(), bias, layer.weight.shape[0], DENSE, []


def _moe_args(block: SparseMoeBlock) -> tuple:
    """decoder.cpp's MoeArgs: what SparseMoeBlock's fused path uses (fused_tables, checked before)."""
    fused = block.fused_tables()
    shared = block.shared_expert
    return (fused.router, block.top_k, block.renormalize, fused.gate_up, fused.down, fused.inter,
            [w.data for pair in fused.packed for w in pair],
            None if shared is None else _linear_args(shared.gate_up_proj),
            None if shared is None else _linear_args(shared.down_proj),
            None if shared is None else block.shared_expert_gate.weight.detach())


def _layer_linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A decoder layer's linear layers: qkv and o, then a dense MLP's, or a sparse one's shared
    expert's (its experts: fused_tables)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        shared = mlp.shared_expert
        return (attn.qkv_proj, attn.o_proj) + (() if shared is None else (shared.gate_up_proj, shared.down_proj))
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _unsupported_reason(model: nn.Module, kv_cache: object, attn_backend: object, tp_size: int) -> str | None:
    from ..layers.attention.torch_native import TorchNativeAttnBackend
    from ..models.llama import LlamaModel

    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel) or not len(inner.layers):
        return f"{type(model).__name__} is not a Llama-family model"
    if (blocker := inner.decoder_blocker()) is not None:
        return blocker
    if tp_size != 1:
        return "tensor parallelism"
    if not isinstance(attn_backend, TorchNativeAttnBackend) or attn_backend.kernels is None:
        return "the CPU attention kernels are not in use"
    if not cpu_ops.enabled():
        return "the fused CPU ops are not in use"
    weight = inner.norm.weight
    if weight.device.type != "cpu" or weight.dtype not in DTYPES:
        return f"{weight.dtype} on {weight.device.type}"
    if kv_cache.dtype != weight.dtype:
        return f"KV cache dtype {kv_cache.dtype} differs from the model's {weight.dtype}"
    first = inner.layers[0].self_attn
    if not TorchNativeAttnBackend.kernel_takes(first.attn, weight.dtype, kv_cache.dtype):
        return "head shape the attention kernel does not take"
    if first.rotary_emb.cos_cache.dtype != torch.float32:
        return "rotary cache not fp32"
    for layer in inner.layers:
        if isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.fused_tables() is None:
            return "MoE experts not in the bf16 gemm layout (bf16 weights and kernels/cpu_moe needed)"
        for linear in _layer_linears(layer):
            quant = linear.packed_weight
            if isinstance(quant, QuantWeight) and not all(p.packed for p in quant.parts):
                return "GGUF weights kept quantized without the quantized kernel"
            if linear.packed_weight is None and linear.weight.dtype != weight.dtype:
                return "mixed weight dtypes"
    return None
