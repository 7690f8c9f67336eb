"""FlashInfer paged metadata (built on CPU) checked through a reference paged attention.

The chain: random paged KV + requests with varied prefix/extend lengths -> `build_paged_meta`
-> `paged_attention_ref` must equal (a) a dense attention computed straight from each request's
token slots and (b) the torch_native backend run through a real ForwardBatch. The CUDA test runs
the real FlashInfer backend against torch_native.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from radixlm.kernels.flashinfer_meta import (
    PagedMeta,
    build_decode_meta,
    build_paged_meta,
    build_paged_meta_host,
    paged_kv_view,
    total_pages_of,
)
from radixlm.kernels.paged_attention_ref import paged_attention_ref
from radixlm.runtime.layers.attention.base import RadixAttention, create_backend
from radixlm.runtime.mem_cache.kv_manager import write_slots
from radixlm.runtime.mem_cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.utils import ceil_div

HAS_TORCH_NATIVE = importlib.util.find_spec("radixlm.runtime.layers.attention.torch_native") is not None
HAS_CUDA_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def make_batch(lens: list[tuple[int, int]], page_size: int, heads: int, kv_heads: int, head_dim: int,
               seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
               mode: ForwardMode = ForwardMode.EXTEND, num_layers: int = 1) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
    """Requests (prefix_len, seq_len) over a paged pool whose pages are handed out interleaved.

    Every slot of the K/V buffer gets random values, so reading a wrong slot shows. Returns the
    ForwardBatch (with this pass's K/V already written) and q, k, v of the new tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    need = sum(ceil_div(s, page_size) for _, s in lens)
    num_pages = 2 * need + 8
    alloc = TokenToKVPoolAllocator(num_pages, page_size)
    kv = KVCache(num_pages, page_size, num_layers, kv_heads, head_dim, dtype, device)
    pool = ReqToTokenPool(len(lens) + 3, max(s for _, s in lens) + 1, device)
    rows = [pool.alloc() for _ in lens]
    table = pool.req_to_token
    last_locs = []
    for row, (p, _) in zip(rows, lens, strict=True):
        alloc.alloc(rnd.randint(1, 2 * page_size))          # a gap, so pages are not contiguous
        if p:
            slots = alloc.alloc(p)
            table[row, :p] = slots.to(table.dtype).to(device)
            last_locs.append(int(slots[-1]))
        else:
            last_locs.append(0)
    prefix_lens, seq_lens = [p for p, _ in lens], [s for _, s in lens]
    out_loc = alloc.alloc_extend(prefix_lens, seq_lens, last_locs)
    assert out_loc is not None
    write_slots(table, rows, prefix_lens, seq_lens, out_loc)
    input_ids = [0] * int(out_loc.numel())
    fb = ForwardBatch.build(mode, input_ids, rows, prefix_lens, seq_lens, out_loc, pool, kv, device)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    n = fb.num_tokens
    q = torch.randn(n, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    kv.set_kv(0, fb.out_cache_loc, k, v)
    return fb, q, k, v


def dense_attention(fb: ForwardBatch, q: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Straight from token positions: request i's query t (position prefix_len + t) attends to the
    slots `req_to_token[row, :prefix_len + t + 1]`."""
    k_buf, v_buf = fb.kv_cache.k_buffer[0], fb.kv_cache.v_buffer[0]
    heads, kv_heads = q.shape[1], k_buf.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    tok = 0
    for i, row in enumerate(fb.req_pool_indices.tolist()):
        for pos in range(fb.prefix_lens_cpu[i], fb.seq_lens_cpu[i]):
            slots = fb.req_to_token_pool.req_to_token[row, :pos + 1].long()
            for h in range(heads):
                kh = k_buf[slots, h * kv_heads // heads].double()            # [pos+1, D]
                vh = v_buf[slots, h * kv_heads // heads].double()
                w = torch.softmax(kh @ q[tok, h].double() * sm_scale, dim=0)
                out[tok, h] = (w @ vh).float()
            tok += 1
    return out


def ref_from_meta(fb: ForwardBatch, q: torch.Tensor, meta: PagedMeta, sm_scale: float) -> torch.Tensor:
    P = fb.kv_cache.page_size
    k_pages = paged_kv_view(fb.kv_cache.k_buffer[0], P)
    v_pages = paged_kv_view(fb.kv_cache.v_buffer[0], P)
    return paged_attention_ref(q, k_pages, v_pages, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                               meta.kv_last_page_len, sm_scale)


def meta_of(fb: ForwardBatch) -> PagedMeta:
    P = fb.kv_cache.page_size
    return build_paged_meta(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.prefix_lens,
                            fb.seq_lens, P, total_pages_of(fb.seq_lens_cpu, P))


CASES = [
    # (prefix_len, seq_len) per request
    [(0, 7)],
    [(0, 1), (0, 33), (16, 40), (32, 33), (5, 21)],
    [(48, 49), (17, 18), (0, 3), (64, 80), (1, 2)],
]


def test_meta_by_hand() -> None:
    # page_size 4; request 0 holds pages 3, 5 (6 tokens), request 1 holds page 2 (1 token).
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[0, :6] = torch.tensor([12, 13, 14, 15, 20, 21], dtype=torch.int32)
    table[1, :1] = torch.tensor([8], dtype=torch.int32)
    meta = build_paged_meta(table, torch.tensor([0, 1]), torch.tensor([4, 0]), torch.tensor([6, 1]), 4)
    assert meta.qo_indptr.tolist() == [0, 2, 3]
    assert meta.kv_indptr.tolist() == [0, 2, 3]
    assert meta.kv_indices.tolist() == [3, 5, 2]
    assert meta.kv_last_page_len.tolist() == [2, 1]
    assert all(t.dtype == torch.int32 for t in meta)
    decode = build_decode_meta(table, torch.tensor([1, 0]), torch.tensor([1, 6]), 4)
    assert decode.qo_indptr.tolist() == [0, 1, 2]
    assert decode.kv_indices.tolist() == [2, 3, 5]
    assert decode.kv_last_page_len.tolist() == [1, 2]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_ref_matches_dense(page_size: int, case: int, heads: int, kv_heads: int) -> None:
    fb, q, _, _ = make_batch(CASES[case], page_size, heads, kv_heads, 16, seed=case)
    meta = meta_of(fb)
    P = page_size
    lens = torch.tensor(fb.seq_lens_cpu)
    kv_lens = (meta.kv_indptr[1:] - meta.kv_indptr[:-1] - 1) * P + meta.kv_last_page_len
    assert torch.equal(kv_lens.long(), lens)
    sm_scale = 16 ** -0.5
    ref = ref_from_meta(fb, q, meta, sm_scale)
    dense = dense_attention(fb, q, sm_scale)
    assert (ref - dense).abs().max().item() <= 1e-5


@pytest.mark.parametrize("page_size", [1, 16])
def test_meta_without_total_pages_hint(page_size: int) -> None:
    fb, _, _, _ = make_batch(CASES[1], page_size, 4, 2, 8, seed=3)
    P = page_size
    hinted = meta_of(fb)
    plain = build_paged_meta(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.prefix_lens,
                             fb.seq_lens, P)
    assert all(torch.equal(a, b) for a, b in zip(hinted, plain, strict=True))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("case", [0, 1, 2, -1])
def test_host_built_meta_equals_device_built(page_size: int, case: int) -> None:
    """The backend plans with indptrs built on the host from the CPU lengths; they must be the
    device-built metadata exactly (the indices gathered on the table's device)."""
    lens = CASES[case] if case >= 0 else [(s - 1, s) for s in (1, 9, 16, 17, 40, 64)]
    fb, _, _, _ = make_batch(lens, page_size, 4, 2, 8, seed=case + 20)
    table = fb.req_to_token_pool.req_to_token
    device_built = build_paged_meta(table, fb.req_pool_indices, fb.prefix_lens, fb.seq_lens, page_size)
    host_built = build_paged_meta_host(table, fb.req_pool_indices, fb.prefix_lens_cpu, fb.seq_lens_cpu,
                                       page_size)
    for name, a, b in zip(PagedMeta._fields, device_built, host_built, strict=True):
        assert b.dtype == torch.int32 and torch.equal(a, b), name
    assert host_built.qo_indptr.is_cpu and host_built.kv_indptr.is_cpu and host_built.kv_last_page_len.is_cpu


@pytest.mark.skipif(not HAS_TORCH_NATIVE, reason="torch_native backend not written yet")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode,case", [(ForwardMode.EXTEND, 1), (ForwardMode.EXTEND, 2),
                                       (ForwardMode.DECODE, -1)])
def test_ref_matches_torch_native(page_size: int, mode: ForwardMode, case: int) -> None:
    lens = CASES[case] if case >= 0 else [(s - 1, s) for s in (1, 9, 16, 17, 40, 64)]
    heads, kv_heads, head_dim, scaling = 8, 2, 16, 0.3
    fb, q, k, v = make_batch(lens, page_size, heads, kv_heads, head_dim, seed=11, mode=mode)
    if mode.is_decode:
        meta = build_decode_meta(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                 page_size)
        assert all(torch.equal(a, b) for a, b in zip(meta, meta_of(fb), strict=True))
    else:
        meta = meta_of(fb)
    backend = create_backend("torch_native")
    backend.init_forward_metadata(fb)
    fb.attn_backend = backend
    layer = RadixAttention(0, heads, kv_heads, head_dim, scaling)
    native = layer(q, k, v, fb).view(-1, heads, head_dim)
    ref = ref_from_meta(fb, q, meta, scaling)
    assert (ref - native).abs().max().item() <= 1e-5


class StandInWrapper:
    """Follows FlashInfer's documented plan/run contract (positional order up to page_size, keywords
    after it; run(q, (k_cache, v_cache)) with NHD pages) and computes with `paged_attention_ref`.
    Lets the CPU check the backend's glue; the CUDA test below runs the real library."""

    def __init__(self, decode: bool):
        self.decode = decode
        self.plans: list[dict] = []

    def plan(self, *args, causal: bool = False, sm_scale: float | None = None,
             q_data_type: torch.dtype = torch.float16, kv_data_type: torch.dtype | None = None,
             window_left: int = -1) -> None:
        if self.decode:
            kv_indptr, kv_indices, last, heads, kv_heads, head_dim, page_size = args
            qo_indptr = torch.arange(last.numel() + 1, dtype=torch.int32)
            assert not causal
        else:
            qo_indptr, kv_indptr, kv_indices, last, heads, kv_heads, head_dim, page_size = args
        assert all(t.dtype == torch.int32 for t in (qo_indptr, kv_indptr, kv_indices, last))
        self.plans.append(dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, last=last,
                               heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                               causal=causal or self.decode, sm_scale=sm_scale, q_dtype=q_data_type,
                               kv_dtype=kv_data_type, window_left=window_left))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        plan = self.plans[-1]
        k_pages, v_pages = paged_kv_cache
        assert k_pages.shape[1:] == (plan["page_size"], plan["kv_heads"], plan["head_dim"])
        assert q.shape == (int(plan["qo_indptr"][-1]), plan["heads"], plan["head_dim"])
        assert q.dtype == plan["q_dtype"] and k_pages.dtype == plan["kv_dtype"]
        return paged_attention_ref(q, k_pages, v_pages, plan["qo_indptr"], plan["kv_indptr"],
                                   plan["kv_indices"], plan["last"], plan["sm_scale"], plan["causal"],
                                   plan["window_left"])


@pytest.mark.skipif(not HAS_TORCH_NATIVE, reason="torch_native backend not written yet")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode,case", [(ForwardMode.EXTEND, 1), (ForwardMode.EXTEND, 2),
                                       (ForwardMode.DECODE, -1)])
def test_flashinfer_backend_glue_with_stand_in(page_size: int, mode: ForwardMode, case: int) -> None:
    from radixlm.runtime.layers.attention.flashinfer_backend import FlashInferAttnBackend

    lens = CASES[case] if case >= 0 else [(s - 1, s) for s in (1, 9, 16, 17, 40, 64)]
    heads, kv_heads, head_dim = 8, 2, 16
    fb, q, k, v = make_batch(lens, page_size, heads, kv_heads, head_dim, seed=2, mode=mode, num_layers=2)
    backend = FlashInferAttnBackend.__new__(FlashInferAttnBackend)
    backend._init_state(heads, kv_heads, head_dim, page_size, "cpu", torch.float32, None)
    backend.prefill_wrapper, backend.decode_wrapper = StandInWrapper(False), StandInWrapper(True)
    backend._new_prefill_wrapper = lambda: StandInWrapper(False)
    backend._new_decode_wrapper = lambda buffers=None: StandInWrapper(True)
    native = create_backend("torch_native")
    layers = [RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5),
              RadixAttention(1, heads, kv_heads, head_dim, 0.3),         # 0.3: q is rescaled
              RadixAttention(0, heads, kv_heads, head_dim, 0.3, sliding_window_size=9)]
    backend.init_forward_metadata(fb)
    fb.attn_backend = backend
    outs = [layer(q, k, v, fb) for layer in layers]
    # the windowed layer ran its own wrapper, planned once with window_left=9 (found at first use)
    windowed = backend.window_wrappers[9][1 if mode.is_decode else 0]
    assert [p["window_left"] for p in windowed.plans] == [9]
    used, unused = ((backend.decode_wrapper, backend.prefill_wrapper) if mode.is_decode
                    else (backend.prefill_wrapper, backend.decode_wrapper))
    assert len(used.plans) == 1 and not unused.plans                     # planned once per pass
    assert isinstance(fb.attn_metadata, PagedMeta)
    native.init_forward_metadata(fb)
    fb.attn_backend = native
    for layer, out in zip(layers, outs, strict=True):
        assert (out - layer(q, k, v, fb)).abs().max().item() <= 1e-5


def test_flashinfer_backend_imports_and_refuses_cpu() -> None:
    import radixlm.runtime.layers.attention.flashinfer_backend as fib
    from radixlm.runtime.layers.attention.base import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS["flashinfer"] is fib.FlashInferAttnBackend
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    with pytest.raises(RuntimeError, match="CUDA"):
        create_backend("flashinfer", num_heads=4, num_kv_heads=2, head_dim=64, page_size=1,
                       device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("head_dim,dtype,match", [(16, torch.bfloat16, "head_dim 16"),
                                                  (128, torch.float32, "float32")])
def test_flashinfer_backend_refuses_unsupported_shapes(head_dim: int, dtype: torch.dtype, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        create_backend("flashinfer", num_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=1,
                       device="cuda", dtype=dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_FLASHINFER, reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode,case", [(ForwardMode.EXTEND, 1), (ForwardMode.EXTEND, 2),
                                       (ForwardMode.DECODE, -1)])
def test_flashinfer_matches_torch_native(page_size: int, dtype: torch.dtype, mode: ForwardMode,
                                         case: int) -> None:
    lens = CASES[case] if case >= 0 else [(s - 1, s) for s in (1, 9, 16, 17, 40, 64)]
    heads, kv_heads, head_dim = 8, 2, 128
    fb, q, k, v = make_batch(lens, page_size, heads, kv_heads, head_dim, seed=5, device="cuda",
                             dtype=dtype, mode=mode)
    layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5)
    outs = []
    for name, kwargs in (("torch_native", {}),
                         ("flashinfer", dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                             page_size=page_size, device="cuda", dtype=dtype))):
        backend = create_backend(name, **kwargs)
        backend.init_forward_metadata(fb)
        fb.attn_backend = backend
        outs.append(layer(q, k, v, fb).float())
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    assert (outs[0] - outs[1]).abs().max().item() <= tol
