"""The C++ CPU paged attention kernels against the torch reference path of torch_native.

Each case builds a real paged pool (pages handed out with gaps, every slot filled with random
values so a wrong slot shows), a ForwardBatch with ragged prefix/extend lengths, and runs the
same RadixAttention layer through the backend with the kernels and without them. The reference
runs on fp32 copies of the same values, so bf16 cases compare against exact math.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.kernels import cpu_attention
from radixlm.runtime.layers.attention.base import RadixAttention
from radixlm.runtime.layers.attention.torch_native import TorchNativeAttnBackend
from radixlm.runtime.mem_cache.kv_manager import write_slots
from radixlm.runtime.mem_cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.utils import ceil_div

KERNELS = cpu_attention.load_cpu_attention()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="CPU attention kernels unavailable (no AVX2/AVX512 or build failed)")

GQA = [(4, 4), (6, 2), (8, 2), (16, 2)]          # (heads, kv_heads): ratios 1, 3, 4, 8


def make_batch(lens: list[tuple[int, int]], page_size: int, heads: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, seed: int, mode: ForwardMode) -> tuple[ForwardBatch, torch.Tensor]:
    """Requests (prefix_len, seq_len); returns the batch (this pass's K/V written) and q."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    num_pages = 2 * sum(ceil_div(s, page_size) + 2 for _, s in lens) + 8
    alloc = TokenToKVPoolAllocator(num_pages, page_size)
    kv = KVCache(num_pages, page_size, 1, kv_heads, head_dim, dtype, "cpu")
    pool = ReqToTokenPool(len(lens) + 3, max(s for _, s in lens) + 1, "cpu")
    rows = [pool.alloc() for _ in lens]
    last_locs = []
    for row, (p, _) in zip(rows, lens):
        alloc.alloc(rnd.randint(1, 2 * page_size))          # a gap: pages are not contiguous
        slots = alloc.alloc(p) if p else None
        if slots is not None:
            pool.req_to_token[row, :p] = slots.to(torch.int32)
        last_locs.append(int(slots[-1]) if slots is not None else 0)
    prefix_lens, seq_lens = [p for p, _ in lens], [s for _, s in lens]
    out_loc = alloc.alloc_extend(prefix_lens, seq_lens, last_locs)
    write_slots(pool.req_to_token, rows, prefix_lens, seq_lens, out_loc)
    fb = ForwardBatch.build(mode, [0] * int(out_loc.numel()), rows, prefix_lens, seq_lens, out_loc, pool, kv, "cpu")
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    q = torch.randn(fb.num_tokens, heads, head_dim, generator=gen).to(dtype)
    return fb, q


def run(fb: ForwardBatch, q: torch.Tensor, layer: RadixAttention, backend: TorchNativeAttnBackend) -> torch.Tensor:
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    if fb.forward_mode.is_decode:
        return backend.forward_decode(q, layer, fb)
    return backend.forward_extend(q, layer, fb)


def reference(fb: ForwardBatch, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
    """The torch path on fp32 copies of q and the KV buffers."""
    kv = fb.kv_cache
    saved = kv.k_buffer, kv.v_buffer
    kv.k_buffer, kv.v_buffer = [b.float() for b in saved[0]], [b.float() for b in saved[1]]
    try:
        return run(fb, q.float(), layer, TorchNativeAttnBackend(use_kernels=False))
    finally:
        kv.k_buffer, kv.v_buffer = saved


def check(fb: ForwardBatch, q: torch.Tensor, layer: RadixAttention, out: torch.Tensor) -> None:
    ref = reference(fb, q, layer)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = 1e-2 if q.dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def kernel_backend() -> TorchNativeAttnBackend:
    backend = TorchNativeAttnBackend()
    assert backend.kernels is KERNELS
    return backend


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(page_size, heads, kv_heads, head_dim, dtype):
    lens = [(s - 1, s) for s in (1, 5, 17, 33, 64, 100, 257)]
    fb, q = make_batch(lens, page_size, heads, kv_heads, head_dim, dtype, seed=heads + head_dim, mode=ForwardMode.DECODE)
    layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5)
    check(fb, q, layer, run(fb, q, layer, kernel_backend()))


@pytest.mark.parametrize("num_splits", [2, 3, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_kv(num_splits, dtype):
    """Explicit splits, including splits that are empty for short requests."""
    heads, kv_heads, head_dim = 8, 2, 64
    lens = [(s - 1, s) for s in (1, 3, 40, 1500)]
    fb, q = make_batch(lens, 16, heads, kv_heads, head_dim, dtype, seed=num_splits, mode=ForwardMode.DECODE)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.3)
    out = torch.empty_like(q)
    KERNELS.decode(out, q, fb.kv_cache.k_buffer[0], fb.kv_cache.v_buffer[0], fb.req_to_token_pool.req_to_token,
                   fb.req_pool_indices, fb.seq_lens, layer.scaling, num_splits)
    check(fb, q, layer, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_batch_invariant(dtype):
    """A request's output has the same bits alone and in any batch (the splits depend on its own
    length): what makes greedy speculative decoding exact in bf16 (a verify pass is a batch of rows)."""
    heads, kv_heads, head_dim = 9, 3, 64
    lens = [(s - 1, s) for s in (5, 130, 700, 3000, 6000, 90)]
    fb, q = make_batch(lens, 16, heads, kv_heads, head_dim, dtype, seed=11, mode=ForwardMode.DECODE)
    args = (fb.kv_cache.k_buffer[0], fb.kv_cache.v_buffer[0], fb.req_to_token_pool.req_to_token)
    together = torch.empty_like(q)
    KERNELS.decode(together, q, *args, fb.req_pool_indices, fb.seq_lens, 0.125, 0)
    for i in range(len(lens)):
        for rows in ([i], [i, 0], [3, i]):
            idx = torch.tensor(rows)
            out = torch.empty_like(q[idx])
            KERNELS.decode(out, q[idx].contiguous(), *args, fb.req_pool_indices[idx], fb.seq_lens[idx], 0.125, 0)
            assert torch.equal(out[rows.index(i)], together[i]), (i, rows)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (8, 2, 128), (6, 2, 32)])
def test_bf16_decode_on_dpbf16_where_the_cpu_has_it(heads, kv_heads, head_dim):
    """bf16 decode multiplies on vdpbf16ps exactly where the CPU has AVX512-BF16 and head_dim is a
    multiple of 64 (decode_dpbf16.h), else on the fp32 loop; both within bf16 rounding of exact math,
    with soft-capping and with splits, and the two apart by no more than that."""
    has = KERNELS.isa() == "avx512" and "avx512_bf16" in cpu_attention.cpu_flags() and head_dim % 64 == 0
    assert KERNELS.decode_micro(head_dim) == ("avx512_bf16" if has else "fma")
    lens = [(s - 1, s) for s in (1, 2, 63, 64, 65, 130, 700)]
    fb, q = make_batch(lens, 1, heads, kv_heads, head_dim, torch.bfloat16, seed=head_dim + heads, mode=ForwardMode.DECODE)
    args = (fb.kv_cache.k_buffer[0], fb.kv_cache.v_buffer[0], fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices, fb.seq_lens, head_dim ** -0.5)
    for splits, cap in ((0, 0.0), (3, 0.0), (0, 4.0)):
        layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5, logit_cap=cap)
        outs = []
        try:
            for allowed in (True, False):
                KERNELS.set_decode_dpbf16(allowed)
                assert KERNELS.decode_micro(head_dim) == ("avx512_bf16" if has and allowed else "fma")
                out = torch.empty_like(q)
                KERNELS.decode(out, q, *args, splits, -1, cap)
                check(fb, q, layer, out)
                outs.append(out.float())
        finally:
            KERNELS.set_decode_dpbf16(True)
        torch.testing.assert_close(outs[0], outs[1], atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_shared_prefix_rows(dtype, page_size):
    """Rows whose tables share a prefix's slots (as the radix cache hands them out): the result
    matches the reference and has the same bits as each request decoded alone."""
    heads, kv_heads, head_dim = 9, 3, 64
    sizes = [1100, 1100, 1150, 700, 1100, 90, 1100, 1100, 1100, 1100, 1100, 1100, 1600, 200, 1040]
    fb, q = make_batch([(s - 1, s) for s in sizes], page_size, heads, kv_heads, head_dim, dtype, seed=5,
                       mode=ForwardMode.DECODE)
    table, rows = fb.req_to_token_pool.req_to_token, fb.req_pool_indices.tolist()
    shared = {1: 1024, 2: 1024, 3: 600, 4: 1024, 6: 1024, 7: 1024, 8: 1024, 9: 1024, 10: 1024, 11: 1024,
              12: 1024, 13: 130, 14: 1030}            # row i's first n slots are row 0's
    for i, n in shared.items():
        table[rows[i], :n] = table[rows[0], :n]
    layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5)
    args = (fb.kv_cache.k_buffer[0], fb.kv_cache.v_buffer[0], table)
    together = torch.empty_like(q)
    KERNELS.decode(together, q, *args, fb.req_pool_indices, fb.seq_lens, layer.scaling, 0)
    check(fb, q, layer, together)
    for i in range(len(sizes)):
        idx = torch.tensor([i])
        alone = torch.empty_like(q[idx])
        KERNELS.decode(alone, q[idx].contiguous(), *args, fb.req_pool_indices[idx], fb.seq_lens[idx], layer.scaling, 0)
        assert torch.equal(alone[0], together[i]), i


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2)])
def test_decode_long_context_auto_splits(heads, kv_heads):
    """Batch 1 at a long context: the kernel picks split-KV on its own."""
    assert KERNELS.decode_num_splits(3000) > 1
    fb, q = make_batch([(2999, 3000)], 1, heads, kv_heads, 64, torch.bfloat16, seed=5, mode=ForwardMode.DECODE)
    layer = RadixAttention(0, heads, kv_heads, 64, 0.125)
    check(fb, q, layer, run(fb, q, layer, kernel_backend()))


EXTEND_LENS = [(0, 7), (16, 40), (5, 6), (32, 100), (0, 1), (10, 150), (48, 49)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_prefix_matches_reference(page_size, heads, kv_heads, head_dim, dtype):
    """Ragged prefix + extend, including one-token extends (decodes in a mixed EXTEND batch)."""
    fb, q = make_batch(EXTEND_LENS, page_size, heads, kv_heads, head_dim, dtype, seed=7 + heads,
                       mode=ForwardMode.EXTEND)
    layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5)
    check(fb, q, layer, run(fb, q, layer, kernel_backend()))


def test_non_contiguous_q_and_small_head_dim():
    """q as a strided view of a fused qkv output; head_dim 16 as in the tiny test models."""
    heads, kv_heads, head_dim = 4, 2, 16
    fb, q = make_batch([(0, 9), (3, 12)], 1, heads, kv_heads, head_dim, torch.float32, seed=3, mode=ForwardMode.EXTEND)
    qkv = torch.randn(q.shape[0], (heads + 2 * kv_heads) * head_dim)
    qv = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    assert not qv.is_contiguous()
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.25)
    check(fb, qv, layer, run(fb, qv, layer, kernel_backend()))


def test_unsupported_dtype_falls_back_to_torch():
    """fp16 is outside the kernels: the backend uses the torch path for that layer."""
    heads, kv_heads, head_dim = 4, 2, 64
    fb, q = make_batch([(3, 4), (0, 5)], 1, heads, kv_heads, head_dim, torch.float16, seed=1, mode=ForwardMode.EXTEND)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.125)
    out = run(fb, q, layer, kernel_backend())
    torch.testing.assert_close(out.float(), reference(fb, q, layer), atol=1e-2, rtol=1e-2)


def test_disable_env_gives_torch_path(monkeypatch):
    monkeypatch.setenv("RADIXLM_DISABLE_CPU_KERNELS", "1")
    cpu_attention.load_cpu_attention.cache_clear()
    try:
        assert cpu_attention.load_cpu_attention() is None
        assert TorchNativeAttnBackend().kernels is None
    finally:
        monkeypatch.delenv("RADIXLM_DISABLE_CPU_KERNELS")
        cpu_attention.load_cpu_attention.cache_clear()
    assert cpu_attention.load_cpu_attention() is not None


def test_pick_isa_from_flags(monkeypatch):
    monkeypatch.delenv("RADIXLM_CPU_KERNEL_ISA", raising=False)
    assert cpu_attention.pick_isa({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}) == "avx512"
    assert cpu_attention.pick_isa({"avx2", "fma"}) == "avx2"
    assert cpu_attention.pick_isa({"sse4_2"}) is None
    monkeypatch.setenv("RADIXLM_CPU_KERNEL_ISA", "avx2")
    assert cpu_attention.pick_isa({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}) == "avx2"


@pytest.mark.slow
@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_attention.cpu_flags(), reason="no AVX2")
def test_avx2_build_matches_reference():
    """The AVX2 path, built separately (one extra compile), on decode with splits and on extend."""
    avx2 = cpu_attention.load_cpu_attention("avx2")
    assert avx2 is not None and avx2.isa() == "avx2" and avx2.decode_micro(64) == "fma"
    backend = TorchNativeAttnBackend()
    backend.kernels = avx2
    for mode, lens in ((ForwardMode.DECODE, [(s - 1, s) for s in (1, 30, 700)]), (ForwardMode.EXTEND, EXTEND_LENS)):
        for dtype in (torch.float32, torch.bfloat16):
            fb, q = make_batch(lens, 16, 8, 2, 64, dtype, seed=9, mode=mode)
            layer = RadixAttention(0, 8, 2, 64, 0.125)
            check(fb, q, layer, run(fb, q, layer, backend))


def test_compiled_forward_keeps_kernel_in_graph():
    """torch.compile(fullgraph=True) over the layer call: the custom ops trace without a break."""
    heads, kv_heads, head_dim = 6, 2, 64
    fb, q = make_batch([(4, 5), (30, 31)], 16, heads, kv_heads, head_dim, torch.bfloat16, seed=4, mode=ForwardMode.DECODE)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.125)
    backend = kernel_backend()
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    compiled = torch.compile(lambda x: backend.forward_decode(x, layer, fb), fullgraph=True, dynamic=False)
    check(fb, q, layer, compiled(q))


# ----------------------------------------------------------------- sliding window
def literal_window_attention(fb: ForwardBatch, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
    """Per request, per query, in fp32: keys [pos - window, pos] (all of [0, pos] when window < 0),
    scores soft-capped when the layer has a logit_cap."""
    k_buf, v_buf = fb.kv_cache.k_buffer[0].float(), fb.kv_cache.v_buffer[0].float()
    group = layer.num_heads // layer.num_kv_heads
    out, t = torch.zeros(q.shape), 0
    for b, (p, s) in enumerate(zip(fb.prefix_lens_cpu, fb.seq_lens_cpu)):
        slots = fb.req_to_token_pool.req_to_token[int(fb.req_pool_indices[b]), :s].long()
        k = k_buf[slots].repeat_interleave(group, dim=1)                 # [s, heads, D]
        v = v_buf[slots].repeat_interleave(group, dim=1)
        for pos in range(p, s):
            lo = 0 if layer.sliding_window_size < 0 else max(0, pos - layer.sliding_window_size)
            scores = torch.einsum("hd,khd->hk", q[t].float(), k[lo:pos + 1]) * layer.scaling
            if layer.logit_cap > 0:
                scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
            out[t] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v[lo:pos + 1])
            t += 1
    return out


@pytest.mark.parametrize("window", [0, 1, 31, 47, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_sliding_window_matches_reference(window, dtype, mode):
    """Kernel vs the torch path, and the torch path vs a literal loop, with keys older than the
    window excluded; lengths straddle the window and the kernel's 32-key blocks."""
    heads, kv_heads, head_dim = 8, 2, 64
    lens = (EXTEND_LENS + [(90, 200), (0, 130)] if mode == ForwardMode.EXTEND
            else [(s - 1, s) for s in (1, 5, 32, 33, 48, 49, 50, 101, 257)])
    fb, q = make_batch(lens, 16, heads, kv_heads, head_dim, dtype, seed=window + 11, mode=mode)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.125, sliding_window_size=window)
    check(fb, q, layer, run(fb, q, layer, kernel_backend()))
    full = RadixAttention(0, heads, kv_heads, head_dim, 0.125)
    ref = reference(fb, q, layer)
    torch.testing.assert_close(ref, literal_window_attention(fb, q, layer), atol=2e-5, rtol=2e-5)
    assert (ref - reference(fb, q, full)).abs().max() > 1e-3     # the window did change the result


@pytest.mark.parametrize("num_splits", [2, 7])
def test_sliding_window_decode_split_kv(num_splits):
    heads, kv_heads, head_dim, window = 8, 2, 64, 47
    lens = [(s - 1, s) for s in (1, 30, 48, 300, 1500)]
    fb, q = make_batch(lens, 16, heads, kv_heads, head_dim, torch.float32, seed=num_splits, mode=ForwardMode.DECODE)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.3, sliding_window_size=window)
    out = torch.empty_like(q)
    KERNELS.decode(out, q, fb.kv_cache.k_buffer[0], fb.kv_cache.v_buffer[0], fb.req_to_token_pool.req_to_token,
                   fb.req_pool_indices, fb.seq_lens, layer.scaling, num_splits, window)
    check(fb, q, layer, out)


# ----------------------------------------------------------------- soft-capped scores (Gemma 2)
@pytest.mark.parametrize("window", [-1, 31])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_logit_cap_matches_reference(window, dtype, mode):
    """Kernel vs the torch path, and the torch path vs a literal loop, with scores soft-capped
    (cap * tanh(s / cap)); the cap is small enough to change the result."""
    heads, kv_heads, head_dim = 8, 2, 64
    lens = EXTEND_LENS if mode == ForwardMode.EXTEND else [(s - 1, s) for s in (1, 33, 50, 257)]
    fb, q = make_batch(lens, 16, heads, kv_heads, head_dim, dtype, seed=5, mode=mode)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.3, sliding_window_size=window, logit_cap=1.5)
    check(fb, q, layer, run(fb, q, layer, kernel_backend()))
    ref = reference(fb, q, layer)
    torch.testing.assert_close(ref, literal_window_attention(fb, q, layer), atol=2e-5, rtol=2e-5)
    uncapped = RadixAttention(0, heads, kv_heads, head_dim, 0.3, sliding_window_size=window)
    assert (ref - reference(fb, q, uncapped)).abs().max() > 1e-2     # the cap did change the result
