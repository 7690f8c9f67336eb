"""torch_native attention: the CPU backend and the reference for the others.

Vectorized over the batch: once per forward pass, `init_forward_metadata` groups the requests
(decodes, i.e. extend_len == 1, apart from longer extends so a long prefill does not pad every
decode to its length) and, per group, builds a padded `[bs, max_kv]` table of KV slots and a
boolean mask. Each layer then gathers K/V for the group in one indexing op and runs one
`scaled_dot_product_attention` call. No Python loop over requests inside a layer.

Causality: the i-th new token of a request sits at position prefix_len + i and may attend to
KV positions j <= prefix_len + i (and j < seq_len).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.runtime.layers.attention.base import AttentionBackend, RadixAttention, register_backend
from radixlm.runtime.model_executor.forward_batch import ForwardBatch


@dataclass
class _Group:
    token_rows: torch.Tensor   # [n_tok] index into the batch's flat tokens
    q_slot: torch.Tensor       # [n_tok] flat index into the padded [bs, max_q] query grid
    bs: int
    max_q: int
    kv_slots: torch.Tensor     # [bs, max_kv] KV slot per (request, position); 0 where padded
    mask: torch.Tensor         # [bs, 1, max_q, max_kv] True = attend


@register_backend("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, **_: object):
        pass

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        ext = fb.extend_lens_cpu
        starts = [0]
        for n in ext:
            starts.append(starts[-1] + n)
        decode_ids = [i for i, n in enumerate(ext) if n == 1]
        extend_ids = [i for i, n in enumerate(ext) if n != 1]
        groups = [self._build_group(fb, ids, starts) for ids in (decode_ids, extend_ids) if ids]
        fb.attn_metadata = groups

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
        return _Group(token_rows, q_slot, bs, max_q, kv_slots, mask)

    def forward_extend(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, layer, fb)

    def forward_decode(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        return self._attend(q, layer, fb)

    def _attend(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        # q: [num_tokens, H, D]
        out = torch.empty_like(q)
        k_buf = fb.kv_cache.k_buffer[layer.layer_id]
        v_buf = fb.kv_cache.v_buffer[layer.layer_id]
        H, D = layer.num_heads, layer.head_dim
        for g in fb.attn_metadata:
            if g.max_q == 1:
                out[g.token_rows] = self._decode_group(q[g.token_rows], k_buf, v_buf, g, layer)
                continue
            qg = q.new_zeros(g.bs * g.max_q, H, D)
            qg[g.q_slot] = q[g.token_rows]
            qg = qg.view(g.bs, g.max_q, H, D).transpose(1, 2)                 # [bs, H, max_q, D]
            k = k_buf[g.kv_slots].transpose(1, 2).to(q.dtype)                 # [bs, KVH, max_kv, D]
            v = v_buf[g.kv_slots].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=layer.scaling,
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
        scores.masked_fill_(~g.mask[:, :, 0, :].unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, v).reshape(bs, H, D)
