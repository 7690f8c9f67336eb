"""A plain-torch paged attention that consumes FlashInfer's metadata: the oracle for those builders.

It reads the same inputs FlashInfer's batch prefill/decode wrappers read (`qo_indptr`, `kv_indptr`,
`kv_indices`, `kv_last_page_len` and the "NHD" paged K/V `[num_pages, page_size, kv_heads,
head_dim]`), and loops over requests in the most literal way, so that it is obviously right.
Speed does not matter here; it is for tests and the GPU check.

Per request i:

    queries  q[qo_indptr[i]:qo_indptr[i+1]]                      qo_len of them
    keys     pages kv_indices[kv_indptr[i]:kv_indptr[i+1]], flattened, first kv_len tokens
             kv_len = (num_pages - 1) * page_size + kv_last_page_len[i]
    causal   query j sits at kv position kv_len - qo_len + j and sees keys [0, that position]
    window   with window_left >= 0 (FlashInfer's argument), only keys [position - window_left, position]

GQA: query head h reads kv head h // (num_heads // num_kv_heads). Math runs in fp32.
"""

from __future__ import annotations

import torch


def paged_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                        qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                        kv_last_page_len: torch.Tensor, sm_scale: float,
                        causal: bool = True, window_left: int = -1) -> torch.Tensor:
    """q: [nnz_qo, num_heads, head_dim]; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim].

    Returns [nnz_qo, num_heads, head_dim] in q's dtype.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    group = num_heads // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qo_ptr, kv_ptr, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_last_page_len.tolist()
    for i in range(len(last)):
        pages = kv_indices[kv_ptr[i]:kv_ptr[i + 1]].to(torch.int64)
        kv_len = (len(pages) - 1) * page_size + last[i]
        k = k_pages[pages].reshape(-1, kv_heads, head_dim)[:kv_len].float()  # [kv_len, kv_heads, D]
        v = v_pages[pages].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        k = k.repeat_interleave(group, dim=1)                                 # [kv_len, heads, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[qo_ptr[i]:qo_ptr[i + 1]].float()                               # [qo_len, heads, D]
        qo_len = qi.shape[0]
        if qo_len == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", qi, k) * sm_scale                # [heads, qo_len, kv_len]
        q_pos = torch.arange(qo_len, device=q.device) + (kv_len - qo_len)
        k_pos = torch.arange(kv_len, device=q.device)
        if causal:
            scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        if window_left >= 0:
            scores = scores.masked_fill(k_pos[None, :] < q_pos[:, None] - window_left, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qo_ptr[i]:qo_ptr[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)
