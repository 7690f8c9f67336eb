"""The fused CPU ops (kernels/cpu_ops) against the eager torch code of the layers, bit for bit.

The references are the layers' own torch paths (`forward_native`), which round where HF does. The
kernels emulate every rounding and torch's fp32 sum order, so results must be equal, bit for bit.
Only fp32 SiLU is allowed one ulp: the kernel's exp (Sleef, as torch's vector path) could differ
from libm's in torch's scalar tail on another build.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import cpu_ops
from radixlm.kernels.cpu_build import cpu_flags
from radixlm.runtime.layers.activation import SiluAndMul
from radixlm.runtime.layers.layernorm import RMSNorm
from radixlm.runtime.layers.rotary import RotaryEmbedding

ops = cpu_ops.load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="fused CPU ops unavailable (no AVX2/AVX512 or no compiler)")

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
SHAPES = [(1, 576), (7, 64), (33, 100), (5, 17), (64, 1536), (3, 1)]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units of the dtype's last place (same-sign finite values)."""
    int_dtype = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return (a.view(int_dtype).to(torch.int64) - b.view(int_dtype).to(torch.int64)).abs()


def assert_close_in_ulps(got: torch.Tensor, want: torch.Tensor, max_ulps: int, max_frac: float) -> None:
    """At most `max_ulps` apart, in at most `max_frac` of the elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    d = ulps(got, want)
    assert int(d.max()) <= max_ulps, f"max {int(d.max())} ulps"
    assert float((d > 0).float().mean()) <= max_frac, f"{float((d > 0).float().mean()):.3%} of elements differ"


def make_norm(d: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(d, eps=9.999999747378752e-06).to(dtype)
    norm.weight.copy_(torch.randn(d, generator=g) * 0.5 + 1)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_torch(shape, dtype):
    n, d = shape
    norm = make_norm(d, dtype, seed=n * d)
    x = (torch.randn(n, d, generator=torch.Generator().manual_seed(d)) * 3).to(dtype)
    x_before = x.clone()
    got = norm(x)
    assert torch.equal(x, x_before)
    assert torch.equal(got, norm.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_matches_torch(shape, dtype):
    n, d = shape
    norm = make_norm(d, dtype, seed=n + d)
    g = torch.Generator().manual_seed(n)
    x, res = (torch.randn(n, d, generator=g) * 2).to(dtype), torch.randn(n, d, generator=g).to(dtype)
    want_x, want_res = norm.forward_native(x.clone(), res.clone())
    got_x, got_res = norm(x, res)
    assert got_x is x and got_res is res                      # in place
    assert torch.equal(got_res, want_res)                      # the sum is rounded once, exactly as torch
    assert torch.equal(got_x, want_x)


def test_rms_norm_per_head_on_strided_view():
    """Qwen3's q_norm: a [n, heads, head_dim] view of the fused qkv output (rows not contiguous)."""
    norm = make_norm(64, torch.bfloat16, seed=1)
    qkv = torch.randn(6, (4 + 2 + 2) * 64).to(torch.bfloat16)
    q = qkv[:, : 4 * 64].reshape(6, 4, 64)
    assert not q.is_contiguous()
    assert torch.equal(norm(q), norm.forward_native(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 1024, 5000, 20000])
def test_rms_norm_sum_order_matches_torch_on_long_rows(d, dtype):
    """Long rows with outliers (sums that are not exact in fp32): the mean must still be torch's."""
    norm = make_norm(d, dtype, seed=d)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, d, generator=g) * torch.exp(torch.randn(9, d, generator=g) * 2)
    x = x.to(dtype)
    assert torch.equal(norm(x), norm.forward_native(x))
    res = torch.randn(9, d, generator=g).to(dtype)
    got, want = norm(x.clone(), res.clone()), norm.forward_native(x.clone(), res.clone())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (9, 64), (4, 100), (3, 7), (40, 96), (2, 65)])
def test_silu_and_mul_matches_torch(shape, dtype):
    n, d = shape
    x = (torch.randn(n, 2 * d, generator=torch.Generator().manual_seed(d)) * 4).to(dtype)
    act = SiluAndMul()
    got, want = act(x), act.forward_native(x)
    if dtype == torch.float32:     # Sleef's exp like torch's vector path; a 1-ulp difference is tolerated
        assert_close_in_ulps(got, want, max_ulps=1, max_frac=0.01)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(9, 3, 64, None), (4, 2, 128, None), (3, 1, 80, None),
                                                                (2, 2, 16, None), (4, 2, 128, 96), (3, 1, 80, 20)])
def test_rotary_matches_torch(heads, kv_heads, head_dim, rotary_dim, dtype):
    """Full and partial rotary (rotary_dim < head_dim: Phi-4-mini's 96 of 128; the lanes past
    rotary_dim unchanged), fused op vs the torch code, bit for bit."""
    rope = RotaryEmbedding(head_dim, 4096, 100000.0, rotary_dim=rotary_dim)
    n = 11
    g = torch.Generator().manual_seed(head_dim + heads)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim: (heads + kv_heads) * head_dim]
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    qkv_before = qkv.clone()
    positions = torch.randint(0, 4096, (n,), generator=g)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()   # in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)       # v untouched
    if rotary_dim is not None:                  # the lanes past rotary_dim pass through, the others turn
        q0 = qkv_before[:, : heads * head_dim].view(n, heads, head_dim)
        assert torch.equal(got_q.view(n, heads, head_dim)[..., rotary_dim:], q0[..., rotary_dim:])
        assert not torch.equal(got_q.view(n, heads, head_dim)[..., :rotary_dim], q0[..., :rotary_dim])


def test_rotary_int32_positions_and_out_of_range():
    rope = RotaryEmbedding(64, 128, 10000.0)
    q, k = torch.randn(3, 128).to(torch.bfloat16), torch.randn(3, 64).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 127], dtype=torch.int32)
    want = rope.forward_native(pos.long(), q.clone(), k.clone())
    ops.rotary_embedding(pos, q, k, rope.cos_cache, rope.sin_cache, 64)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        ops.rotary_embedding(torch.tensor([0, 1, 128]), q, k, rope.cos_cache, rope.sin_cache, 64)


def test_unsupported_inputs_use_the_torch_path():
    norm = make_norm(8, torch.float64, seed=0)
    x = torch.randn(2, 8, dtype=torch.float64)
    assert torch.equal(norm(x), norm.forward_native(x))                      # float64: torch code
    act = SiluAndMul()
    x4 = torch.randn(2, 3, 4, 16).to(torch.bfloat16)                         # 4-D: torch code
    assert torch.equal(act(x4), act.forward_native(x4))


def test_disable_switch(monkeypatch):
    monkeypatch.setenv("RADIXLM_DISABLE_FUSED_OPS", "1")
    cpu_ops.load_cpu_ops.cache_clear()
    try:
        assert cpu_ops.load_cpu_ops() is None
    finally:
        monkeypatch.delenv("RADIXLM_DISABLE_FUSED_OPS")
        cpu_ops.load_cpu_ops.cache_clear()
    assert cpu_ops.load_cpu_ops() is not None


def test_compiled_layers_keep_ops_in_graph():
    """torch.compile(fullgraph=True) over norm + rotary + silu: the custom ops trace without a break
    and give the eager kernels' results."""
    norm, act, rope = make_norm(128, torch.bfloat16, seed=2), SiluAndMul(), RotaryEmbedding(64, 256, 10000.0)

    def step(x, res, positions):
        h, res = norm(x, res)
        q, k = h[:, :64], h[:, 64:]
        q, k = rope(positions, q, k)
        return act(h), res

    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(5, 128, generator=g).to(torch.bfloat16), torch.randn(5, 128, generator=g).to(torch.bfloat16)
    pos = torch.arange(5)
    want = step(x.clone(), res.clone(), pos)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x.clone(), res.clone(), pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def argmax_cases(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Rows of many ties, NaNs, infinities, a vector-width tail and a row stride."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for d in (1, 7, 16, 17, 33, 100, 49152):
        ties = torch.randint(-3, 3, (5, d), generator=g).to(dtype)
        r = torch.rand(5, d, generator=g)
        odd = ties.clone()
        odd[r < 0.05] = float("nan")
        odd[(r > 0.5) & (r < 0.55)] = float("inf")
        odd[(r > 0.6) & (r < 0.65)] = float("-inf")
        odd[3] = float("-inf")
        strided = torch.randn(5, d + 9, generator=g).to(dtype)[:, 4:4 + d]
        cases += [ties, odd, strided, torch.randn(64, d, generator=g).to(dtype)]
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_matches_torch_max(dtype):
    """The first index of the max, the first NaN's in a row with one: torch.max(dim).indices."""
    for x in argmax_cases(dtype, seed=5):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        ops.argmax_rows(out, x)
        assert torch.equal(out, x.max(dim=-1).indices), (x.shape, x.stride())
    with pytest.raises(RuntimeError, match="argmax_rows"):
        ops.argmax_rows(torch.empty(2, dtype=torch.int32), torch.zeros(2, 4))


def test_greedy_sampler_uses_the_kernel(monkeypatch):
    from radixlm.runtime.layers.sampler import argmax_rows
    seen = []
    real = cpu_ops.call
    monkeypatch.setattr(cpu_ops, "call", lambda name, *args: (seen.append(name), real(name, *args)))
    x = torch.randn(3, 1000)
    assert torch.equal(argmax_rows(x), x.max(dim=-1).indices) and seen == ["argmax_rows"]


@pytest.mark.slow
@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="no AVX2")
def test_avx2_build_matches_torch():
    """The AVX2 path, built separately (one extra compile), on every op and dtype."""
    avx2 = cpu_ops.load_cpu_ops("avx2")
    assert avx2 is not None and avx2.isa() == "avx2"
    g = torch.Generator().manual_seed(11)
    for dtype in DTYPES:
        norm, act, rope = make_norm(100, dtype, seed=4), SiluAndMul(), RotaryEmbedding(80, 512, 10000.0)
        x, res = torch.randn(9, 100, generator=g).to(dtype), torch.randn(9, 100, generator=g).to(dtype)
        out = torch.empty_like(x)
        avx2.rms_norm(out, x, norm.weight, norm.eps)
        assert torch.equal(out, norm.forward_native(x))
        want = norm.forward_native(x.clone(), res.clone())
        avx2.fused_add_rms_norm(x, res, norm.weight, norm.eps)
        assert torch.equal(x, want[0]) and torch.equal(res, want[1])
        gu = (torch.randn(9, 2 * 100, generator=g) * 4).to(dtype)
        out = torch.empty(9, 100, dtype=dtype)
        avx2.silu_and_mul(out, gu)
        if dtype == torch.float32:
            assert_close_in_ulps(out, act.forward_native(gu), max_ulps=1, max_frac=0.01)
        else:
            assert torch.equal(out, act.forward_native(gu))
        q, k = torch.randn(9, 3 * 80, generator=g).to(dtype), torch.randn(9, 80, generator=g).to(dtype)
        pos = torch.randint(0, 512, (9,), generator=g)
        want = rope.forward_native(pos, q.clone(), k.clone())
        avx2.rotary_embedding(pos, q, k, rope.cos_cache, rope.sin_cache, 80)
        assert torch.equal(q, want[0]) and torch.equal(k, want[1])
        for x in argmax_cases(dtype, seed=6):
            out = torch.empty(x.shape[0], dtype=torch.int64)
            avx2.argmax_rows(out, x)
            assert torch.equal(out, x.max(dim=-1).indices)
