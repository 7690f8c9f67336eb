"""GGUF k-quants (Q4_K, Q5_K, Q6_K) in kernels/cpu_quant/kquant.h: repack + dequantize_rows exact
against gguf.quants.dequantize, and the kernel against dequantize-then-matmul.

Random bytes are valid k-quant blocks once the fp16 scales (d, dmin) are set to sane values: every
code, 6-bit scale/min and int8 scale is meaningful. Product tolerance: the kernel rounds x to int8
per block of 32 (error <= max|x| / 254 per element, as quant.h's types); the reference takes the same
rounded x, so the two differ only by fp32 summation order: 1e-4 relative to the sum of |w| |x|.
Against unrounded x the error is bounded by sum |w| * max|x_block| / 254.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.kernels.cpu_quant import cpu_supports_quant, load_cpu_quant

gguf = pytest.importorskip("gguf")

BYTES = {12: 144, 13: 176, 14: 210}
SCALE_AT = {12: [0, 2], 13: [0, 2], 14: [208]}     # byte offsets of the fp16 scales in a block


def random_kquant(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k / 256 * bytes] uint8: random valid blocks of `qtype` with fp16 scales in [1e-3, 1e-2)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // 256, BYTES[qtype]), dtype=np.uint8)
    for at in SCALE_AT[qtype]:
        raw[:, at:at + 2] = rng.uniform(1e-3, 1e-2, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).copy()).float()


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: per row and block of 32, to int8 steps of max|x| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(dx > 0, torch.round(blocks / torch.where(dx > 0, dx, 1)), 0)
    return (q * dx).reshape(x.shape)


needs_kernel = pytest.mark.skipif(not cpu_supports_quant(), reason="needs AVX512-VNNI")


def _packed(raw: np.ndarray, qtype: int, n: int, k: int) -> torch.Tensor:
    mod = load_cpu_quant()
    out = torch.empty(mod.k_packed_bytes(qtype, n, k), dtype=torch.uint8)
    mod.k_repack(torch.from_numpy(raw).contiguous().view(-1), qtype, n, k, out)
    return out


@needs_kernel
@pytest.mark.parametrize("qtype", [12, 13, 14])
@pytest.mark.parametrize("n", [1, 37])
def test_dequantize_rows_exact(qtype, n):
    k = 512
    raw = random_kquant(qtype, n, k, seed=qtype + n)
    packed = _packed(raw, qtype, n, k)
    ids = torch.tensor([n - 1, 0] + list(range(n)), dtype=torch.long)
    got = load_cpu_quant().k_dequantize_rows(packed, qtype, n, k, ids)
    want = reference(raw, qtype)[ids]
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("qtype", [12, 13, 14])
def test_torch_fallback_dequantize_exact(qtype):
    from radixlm.runtime.layers.quant_linear import dequantize

    raw = random_kquant(qtype, 3, 256, seed=1)
    assert torch.equal(dequantize(torch.from_numpy(raw), qtype), reference(raw, qtype))


@needs_kernel
@pytest.mark.parametrize("qtype", [12, 13, 14])
@pytest.mark.parametrize("n,m", [(40, 1), (16, 3), (33, 17), (7, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_dequantize_then_matmul(qtype, n, m, dtype):
    k = 768
    raw = random_kquant(qtype, n, k, seed=qtype * 100 + n)
    w = reference(raw, qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = load_cpu_quant().linear(x, _packed(raw, qtype, n, k), qtype, n)
    assert y.shape == (m, n) and y.dtype == dtype
    want = int8_rounded(x) @ w.T
    scale = int8_rounded(x).abs() @ w.abs().T
    out_tol = 1e-4 if dtype == torch.float32 else 2 ** -8       # bf16 output rounding
    err = ((y.float() - want).abs() / (scale + 1e-30)).max().item()
    assert err <= out_tol, err
    # and against unrounded x, within the int8 rounding bound
    exact = x.float() @ w.T
    bound = (w.abs() @ (x.float().reshape(m, -1, 32).abs().amax(-1).repeat_interleave(32, 1) / 254).T).T
    assert ((y.float() - exact).abs() <= bound * 1.01 + out_tol * scale).all()


@needs_kernel
def test_refuses_bad_sizes():
    mod = load_cpu_quant()
    with pytest.raises(RuntimeError, match="multiple of 256"):
        mod.k_packed_bytes(12, 16, 128)
    with pytest.raises(RuntimeError, match="unsupported"):
        mod.k_packed_bytes(2, 16, 256)
