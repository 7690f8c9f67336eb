"""torch_native attention: the CPU backend and the reference for the others.

On CPU, when the C++ kernels in `radixlm.kernels.cpu_attention` load (the default), both decode
and extend run them: they read K/V in place through `req_to_token`, with no gather or padded copy.
A bf16 extend runs either the AVX512/AVX2 kernel or the brgemm one (matrix units), whichever
extend_select.py measured faster for the head shape (at backend creation when the shape is given,
else at the first extend); a mixed batch runs one kernel per run of like requests (its decodes on
the decode kernel, see extend_select.runs).
`RADIXLM_DISABLE_CPU_KERNELS=1`, a non-CPU device, or an unsupported shape/dtype selects the torch
code below, which stays the reference the kernels are tested against.

The torch code is vectorized over the batch: once per forward pass, `init_forward_metadata` groups the requests
(decodes, i.e. extend_len == 1, apart from longer extends so a long prefill does not pad every
decode to its length) and, per group, builds a padded `[bs, max_kv]` table of KV slots and a
boolean mask. Each layer then gathers K/V for the group in one indexing op and runs one
`scaled_dot_product_attention` call. No Python loop over requests inside a layer.

Causality: the i-th new token of a request sits at position prefix_len + i and may attend to
KV positions j <= prefix_len + i (and j < seq_len). A layer with `sliding_window_size` w >= 0 also
needs j >= prefix_len + i - w (the kernels take it as `window_left`; the torch code ANDs it into
the group's mask, built once per pass per window).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ....kernels.cpu_attention import load_cpu_attention
from ...model_executor.forward_batch import ForwardBatch
from . import extend_select
from .base import AttentionBackend, RadixAttention, register_backend

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class _Group:
    token_rows: torch.Tensor   # [n_tok] index into the batch's flat tokens
    q_slot: torch.Tensor       # [n_tok] flat index into the padded [bs, max_q] query grid
    bs: int
    max_q: int
    kv_slots: torch.Tensor     # [bs, max_kv] KV slot per (request, position); 0 where padded
    mask: torch.Tensor         # [bs, 1, max_q, max_kv] True = attend
    q_pos: torch.Tensor        # [bs, 1, max_q, 1] position of each query (prefix_len + i)
    window_masks: dict[int, torch.Tensor]  # sliding_window_size -> mask & the window, built on first use

    def mask_for(self, window: int) -> torch.Tensor:
        """The mask for a layer with this sliding_window_size (-1: the causal mask itself)."""
        if window < 0:
            return self.mask
        if window not in self.window_masks:
            j = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.window_masks[window] = self.mask & (j >= self.q_pos - window)
        return self.window_masks[window]


@dataclass
class _Run:
    """Requests [b0, b1) of a pass, whose queries are q[q0:q1], run by one kernel call; all int64 on CPU."""
    kind: str                       # extend_select.runs' kind ("decode" for every request of a decode pass)
    q0: int
    q1: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    qo_indptr: torch.Tensor | None  # from 0 at q0 (None for a decode run)
    kernel: str | None = None       # "decode" | "simd" | "brgemm", decided at the pass's first layer


@dataclass
class _KernelMeta:
    """What the C++ kernels read: the pass cut into runs; `groups` is built only if a layer falls back."""
    runs: list[_Run]
    groups: list[_Group] | None = None


@register_backend("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, device: str | torch.device = "cpu", use_kernels: bool = True, num_heads: int | None = None,
                 num_kv_heads: int | None = None, head_dim: int | None = None, dtype: torch.dtype | None = None,
                 **_: object):
        """Builds/loads the CPU kernels when on CPU (may compile on first use, see cpu_attention). Given a
        bf16 model's head shape, also picks its extend kernel now (may time both, about a second)."""
        on_cpu = torch.device(device).type == "cpu"
        self.kernels = load_cpu_attention() if (use_kernels and on_cpu) else None
        if (self.kernels is not None and num_heads and num_kv_heads and head_dim and dtype is not None
                and extend_select.brgemm_takes(dtype, dtype, head_dim)):
            extend_select.choose(self.kernels, num_heads, num_kv_heads, head_dim)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self.kernels is not None and fb.input_ids.device.type == "cpu":
            fb.attn_metadata = self._kernel_meta(fb)
        else:
            fb.attn_metadata = self._build_groups(fb)

    @staticmethod
    def _kernel_meta(fb: ForwardBatch) -> _KernelMeta:
        """Cheap per pass: no table reads, no copies beyond dtype/contiguity fixes."""
        i64 = lambda t: t.to(torch.int64).contiguous()  # noqa: E731
        rows, seq_lens, prefix_lens = i64(fb.req_pool_indices), i64(fb.seq_lens), i64(fb.prefix_lens)
        ext = fb.extend_lens_cpu
        if fb.forward_mode.is_decode or all(n == 1 for n in ext):
            return _KernelMeta([_Run("decode", 0, len(ext), rows, seq_lens, prefix_lens, None)])
        starts = list(itertools.accumulate(ext, initial=0))
        qo_indptr = torch.tensor(starts, dtype=torch.int64)
        return _KernelMeta([_Run(kind, starts[b0], starts[b1], rows[b0:b1], seq_lens[b0:b1], prefix_lens[b0:b1],
                                 qo_indptr[b0:b1 + 1] - starts[b0])
                            for b0, b1, kind in extend_select.runs(ext)])

    def _build_groups(self, fb: ForwardBatch) -> list[_Group]:
        ext = fb.extend_lens_cpu
        starts = list(itertools.accumulate(ext, initial=0))
        decode_ids = [i for i, n in enumerate(ext) if n == 1]
        extend_ids = [i for i, n in enumerate(ext) if n != 1]
        return [self._build_group(fb, ids, starts) for ids in (decode_ids, extend_ids) if ids]

    @staticmethod
    def _build_group(fb: ForwardBatch, ids: list[int], starts: list[int]) -> _Group:
        dev = fb.input_ids.device
        prefix = [fb.prefix_lens_cpu[i] for i in ids]
        seq = [fb.seq_lens_cpu[i] for i in ids]
        ext = [s - p for s, p in zip(seq, prefix)]
        bs, max_q, max_kv = len(ids), max(ext), max(seq)
        token_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in ids]).to(dev)
        q_slot = torch.cat([torch.arange(n) + b * max_q for b, n in enumerate(ext)]).to(dev)
        rows = fb.req_pool_indices[torch.tensor(ids, device=dev)]
        kv_slots = fb.req_to_token_pool.req_to_token[rows, :max_kv].to(torch.int64)
        seq_t = torch.tensor(seq, device=dev)
        prefix_t = torch.tensor(prefix, device=dev)
        j = torch.arange(max_kv, device=dev)
        i = torch.arange(max_q, device=dev)
        valid_kv = j[None, :] < seq_t[:, None]                                   # [bs, max_kv]
        kv_slots = torch.where(valid_kv, kv_slots, torch.zeros_like(kv_slots))
        causal = j[None, None, :] <= (prefix_t[:, None, None] + i[None, :, None])  # [bs, max_q, max_kv]
        mask = (causal & valid_kv[:, None, :]).unsqueeze(1)
        q_pos = (prefix_t[:, None] + i[None, :]).view(bs, 1, max_q, 1)
        return _Group(token_rows, q_slot, bs, max_q, kv_slots, mask, q_pos, {})

    def forward_extend(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, layer, fb)

    def forward_decode(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, layer, fb)

    def _attend(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        # q: [num_tokens, H, D]
        k_buf = fb.kv_cache.k_buffer[layer.layer_id]
        v_buf = fb.kv_cache.v_buffer[layer.layer_id]
        meta = fb.attn_metadata
        if isinstance(meta, _KernelMeta):
            if self._kernel_fits(q, k_buf, layer):
                return self._attend_kernel(q, k_buf, v_buf, layer, fb, meta)
            if meta.groups is None:
                meta.groups = self._build_groups(fb)
            meta = meta.groups
        return self._attend_torch(q, k_buf, v_buf, layer, meta)

    @staticmethod
    def kernel_takes(layer: RadixAttention, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether the C++ kernels take this layer's head shape and these dtypes."""
        return (q_dtype in _KERNEL_DTYPES and kv_dtype in _KERNEL_DTYPES and layer.head_dim in (16, 32, 64, 128, 256)
                and layer.num_heads % layer.num_kv_heads == 0 and layer.num_heads // layer.num_kv_heads <= 16)

    @classmethod
    def _kernel_fits(cls, q: torch.Tensor, k_buf: torch.Tensor, layer: RadixAttention) -> bool:
        return q.stride(2) == 1 and cls.kernel_takes(layer, q.dtype, k_buf.dtype)

    def _attend_kernel(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, meta: _KernelMeta) -> torch.Tensor:
        """In-place paged attention (C++). Reads K/V through req_to_token; writes a new output."""
        table = fb.req_to_token_pool.req_to_token
        # under torch.compile the registered custom ops keep the graph whole; eager calls skip the dispatcher
        ops = torch.ops.radixlm if torch.compiler.is_compiling() else None
        parts = []
        for run in meta.runs:
            if run.kernel is None:        # one head shape per pass: the first layer decides for all
                run.kernel = extend_select.kernel_for(self.kernels, layer, run.kind, q.dtype, k_buf.dtype)
            q_run = q[run.q0:run.q1]
            o = torch.empty(q_run.shape, dtype=q.dtype)
            if run.kernel == "decode":
                fn = ops.cpu_paged_decode if ops else self.kernels.decode
                fn(o, q_run, k_buf, v_buf, table, run.req_pool_indices, run.seq_lens, layer.scaling, 0,
                   layer.sliding_window_size, layer.logit_cap)
            else:
                if run.kernel == "brgemm":
                    fn = ops.cpu_paged_extend_brgemm if ops else self.kernels.extend_brgemm
                else:
                    fn = ops.cpu_paged_extend if ops else self.kernels.extend
                fn(o, q_run, k_buf, v_buf, table, run.req_pool_indices, run.prefix_lens, run.seq_lens,
                   run.qo_indptr, layer.scaling, layer.sliding_window_size, layer.logit_cap)
            parts.append(o)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend_torch(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention,
                      groups: list[_Group]) -> torch.Tensor:
        out = torch.empty_like(q)
        H, D = layer.num_heads, layer.head_dim
        for g in groups:
            if g.max_q == 1:
                out[g.token_rows] = self._decode_group(q[g.token_rows], k_buf, v_buf, g, layer)
                continue
            qg = q.new_zeros(g.bs * g.max_q, H, D)
            qg[g.q_slot] = q[g.token_rows]
            qg = qg.view(g.bs, g.max_q, H, D).transpose(1, 2)                 # [bs, H, max_q, D]
            k = k_buf[g.kv_slots].transpose(1, 2).to(q.dtype)                 # [bs, KVH, max_kv, D]
            v = v_buf[g.kv_slots].transpose(1, 2).to(q.dtype)
            mask = g.mask_for(layer.sliding_window_size)
            if layer.logit_cap > 0:
                o = _soft_capped_attention(qg, k, v, mask, layer)
            else:
                o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=layer.scaling,
                                                   enable_gqa=layer.num_heads != layer.num_kv_heads)
            o = o.transpose(1, 2).reshape(g.bs * g.max_q, H, D)
            out[g.token_rows] = o[g.q_slot]
        return out

    @staticmethod
    def _decode_group(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, g: _Group,
                      layer: RadixAttention) -> torch.Tensor:
        """One new token per request: two batched matmuls over the GQA groups (SDPA's masked CPU
        path is several times slower for a single query row)."""
        bs, H, D, KVH = g.bs, layer.num_heads, layer.head_dim, layer.num_kv_heads
        qg = q.view(bs, KVH, H // KVH, D)                                       # [bs, KVH, G, D]
        k = k_buf[g.kv_slots].to(q.dtype).permute(0, 2, 3, 1)                  # [bs, KVH, D, L]
        v = v_buf[g.kv_slots].to(q.dtype).transpose(1, 2)                       # [bs, KVH, L, D]
        scores = torch.matmul(qg, k).float() * layer.scaling                    # [bs, KVH, G, L]
        if layer.logit_cap > 0:
            scores = torch.tanh(scores / layer.logit_cap) * layer.logit_cap
        mask = g.mask_for(layer.sliding_window_size)
        scores.masked_fill_(~mask[:, :, 0, :].unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).reshape(bs, H, D)


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           layer: RadixAttention) -> torch.Tensor:
    """SDPA with scores soft-capped before the mask (SDPA itself cannot): q [bs, H, Q, D], k/v
    [bs, KVH, L, D], mask [bs, 1, Q, L] -> [bs, H, Q, D]."""
    rep = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * layer.scaling
    scores = torch.tanh(scores / layer.logit_cap) * layer.logit_cap
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(q.dtype)   # padded query rows: all masked
    return torch.matmul(probs, v)
