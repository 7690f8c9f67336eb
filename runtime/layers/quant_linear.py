"""GGUF block-quantized weights kept quantized in memory, and their matmul and row lookup.

A `QuantWeight` is an [out_features, in_features] weight held as one or more row ranges ("parts"),
each in one GGUF type (a fused qkv may mix types). A part holds the file's bytes, repacked for
kernels/cpu_quant's AVX512-VNNI kernel when that is on (same bytes per weight; Q4_K/Q5_K 4 more bytes
per 256 weights, their 6-bit scales unpacked), else as in the file:

    w = quant_weight([(raw, qtype, rows)], in_features)   # raw: the file's uint8 bytes, row-major
    w = quant_weight([q, k, v], in_features)              # fused layers: shards stacked along out
    y = w.linear(x)                                       # x [n, in] -> [n, out] in x's dtype
    e = w.rows(ids, dtype)                                # embedding lookup: rows dequantized

`linear()` in packed_linear.py dispatches here when a layer's `packed_weight` is a QuantWeight. With
the kernel on, each part's product goes through the kernel quant_select.py chose for its row count:
the decode kernel (vnni) for a few rows, the prefill GEMM (gemm) or bf16 tiles through oneDNN
(dequant) for many, all on the same repacked bytes.
Without the kernel (`--disable-cpu-kernels`, a CPU without AVX512-VNNI) the torch code dequantizes
the part (`dequantize`, exact vs gguf.quants.dequantize) and multiplies in fp32: correct, slow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kernels.cpu_quant import KERNEL_TYPES, KQUANT_TYPES, load_cpu_quant
from .quant_select import TILE_BYTES, kernel_for

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8       # ggml's type numbers (gguf.GGMLQuantizationType)
QK = 32                                             # weights per block
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34}
Q4_K, Q5_K, Q6_K = 12, 13, 14                       # k-quants: 256-weight super-blocks (kernels/cpu_quant/kquant.h)
K_BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210}
QUANT_TYPES = frozenset(BLOCK_BYTES) | frozenset(K_BLOCK_BYTES)   # the types kept quantized


@dataclass
class QuantPart:
    """`rows` output rows of one GGUF type. `data`: repacked bytes if `packed`, else the file's [rows, bytes/row]."""

    qtype: int
    rows: int
    data: torch.Tensor
    packed: bool


@dataclass
class QuantWeight:
    parts: list[QuantPart]
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)

    def numel(self) -> int:          # bytes, with element_size() 1 (as packed_weight_bytes counts them)
        return sum(p.data.numel() for p in self.parts)

    def element_size(self) -> int:
        return 1

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + bias. x: [n, in] -> [n, out] in x's dtype."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        outs = [part_linear(p, x, self.in_features) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if bias is None else y + bias

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` [n] (int) dequantized: [n, in] in `dtype`."""
        ids = ids.reshape(-1).long()
        if len(self.parts) == 1:
            return _part_rows(self.parts[0], ids, self.in_features).to(dtype)
        out = torch.empty(ids.numel(), self.in_features, dtype=dtype)
        start = 0
        for p in self.parts:
            mine = (ids >= start) & (ids < start + p.rows)
            if bool(mine.any()):
                out[mine] = _part_rows(p, ids[mine] - start, self.in_features).to(dtype)
            start += p.rows
        return out


def _merged(shards: list[tuple[torch.Tensor, int, int]]) -> list[tuple[list[torch.Tensor], int, int]]:
    """Consecutive shards of one type joined: [(raws, type, rows)]."""
    merged: list[tuple[list[torch.Tensor], int, int]] = []
    for raw, qtype, rows in shards:
        if qtype not in QUANT_TYPES:
            raise ValueError(f"GGUF type {qtype} is not kept quantized")
        if merged and merged[-1][1] == qtype:
            merged[-1] = (merged[-1][0] + [raw.reshape(rows, -1)], qtype, merged[-1][2] + rows)
        else:
            merged.append(([raw.reshape(rows, -1)], qtype, rows))
    return merged


def packed_bytes(shards: list[tuple[torch.Tensor, int, int]], in_features: int) -> int:
    """Bytes quant_weight takes from `alloc` for these shards (0 when the kernel is off)."""
    mod = load_cpu_quant()
    return 0 if mod is None else sum(_fn(mod, t, "packed_bytes")(t, rows, in_features)
                                     for _, t, rows in _merged(shards) if t in KERNEL_TYPES | KQUANT_TYPES)


def quant_weight(shards: list[tuple[torch.Tensor, int, int]], in_features: int,
                 alloc: Callable[[int], torch.Tensor] | None = None) -> QuantWeight:
    """A QuantWeight from (file bytes, GGUF type, rows) shards stacked along the output dim.

    Consecutive shards of one type become one part (one kernel call); each part is repacked for
    the kernel when it is on (into `alloc(nbytes)`, a uint8 buffer; default a new tensor), else
    kept in the file's layout.
    """
    parts = []
    for raws, qtype, rows in _merged(shards):
        raw = torch.cat(raws).contiguous()
        mod = load_cpu_quant() if qtype in KERNEL_TYPES | KQUANT_TYPES else None
        if mod is None:
            parts.append(QuantPart(qtype, rows, raw, packed=False))
            continue
        nbytes = _fn(mod, qtype, "packed_bytes")(qtype, rows, in_features)
        out = alloc(nbytes) if alloc is not None else torch.empty(nbytes, dtype=torch.uint8)
        _fn(mod, qtype, "repack")(raw, qtype, rows, in_features, out)
        parts.append(QuantPart(qtype, rows, out, packed=True))
    return QuantWeight(parts, in_features)


def _fn(mod, qtype: int, name: str):
    """The extension's `name` binding for `qtype`: the k_* ones (kquant.h) for the k-quants, except
    `linear`, which takes every type."""
    return getattr(mod, f"k_{name}" if qtype in K_BLOCK_BYTES and name != "linear" else name)


def part_linear(p: QuantPart, x: torch.Tensor, in_features: int, kernel: str | None = None) -> torch.Tensor:
    """x [n, in] @ the part's rows.T -> [n, rows], through `kernel` (default: quant_select's choice for n)."""
    if p.packed and x.dtype in (torch.bfloat16, torch.float32):
        mod = load_cpu_quant()
        kernel = kernel or kernel_for(p.qtype, in_features, x.dtype, x.shape[0])
        if kernel == "gemm" and x.shape[0] > 0:
            return mod.gemm(x, p.data, p.qtype, p.rows)
        if kernel == "dequant" and x.dtype == torch.bfloat16 and x.shape[0] > 0:
            return _dequant_linear(mod, p, x, in_features)
        return _fn(mod, p.qtype, "linear")(x, p.data, p.qtype, p.rows)
    w = _part_rows(p, None, in_features)                       # [rows, in] fp32
    return (x.float() @ w.T).to(x.dtype)


def _dequant_linear(mod, p: QuantPart, x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x @ W.T with W dequantized to bf16 a tile of rows (about TILE_BYTES) at a time, each tile
    multiplied by F.linear (oneDNN); no bf16 copy of the whole weight is kept."""
    out = torch.empty(x.shape[0], p.rows, dtype=x.dtype)
    groups = -(-p.rows // 16)
    step = max(1, TILE_BYTES // (2 * 16 * in_features))
    for g0 in range(0, groups, step):
        g1 = min(groups, g0 + step)
        tile = mod.dequantize_bf16(p.data, p.qtype, p.rows, in_features, g0, g1)
        out[:, 16 * g0: 16 * g0 + tile.shape[0]] = F.linear(x, tile)
    return out


def _part_rows(p: QuantPart, ids: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """Rows `ids` (all when None) of a part, dequantized to fp32: [len(ids), in]."""
    if p.packed:
        ids = torch.arange(p.rows) if ids is None else ids
        return _fn(load_cpu_quant(), p.qtype, "dequantize_rows")(p.data, p.qtype, p.rows, in_features, ids)
    raw = p.data if ids is None else p.data[ids]
    return dequantize(raw, p.qtype).reshape(raw.shape[0], in_features)


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The file's bytes [rows, bytes/row] (uint8) of one GGUF type -> fp32 [rows, weights/row]."""
    if qtype in K_BLOCK_BYTES:                       # k-quants: the gguf package's numpy dequantizer
        from gguf import GGMLQuantizationType
        from gguf import dequantize as gguf_dequantize

        return torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType(qtype))).reshape(raw.shape[0], -1)
    blocks = raw.reshape(-1, BLOCK_BYTES[qtype])
    d = blocks[:, :2].contiguous().view(torch.float16).float()             # [nb, 1]
    if qtype == Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(raw.shape[0], -1)
    has_min = qtype in (Q4_1, Q5_1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float() if has_min else None
    at = 4 if has_min else 2
    codes = blocks[:, -16:]                                                  # byte i: weight i low, i + 16 high
    q = torch.cat([codes & 0x0F, codes >> 4], dim=1).int()                  # [nb, 32]
    if qtype in (Q5_0, Q5_1):
        qh = blocks[:, at:at + 4].contiguous().view(torch.int32)             # [nb, 1], bit i: weight i's fifth
        q = q | (((qh >> torch.arange(32, dtype=torch.int32)) & 1) << 4)
    if has_min:
        return (d * q.float() + m).reshape(raw.shape[0], -1)
    zero = 16 if qtype == Q5_0 else 8
    return (d * (q - zero).float()).reshape(raw.shape[0], -1)
