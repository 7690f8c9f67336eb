"""kernels/cpu_quant and runtime/layers/quant_linear.py: GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights kept quantized.

Dequantization (torch code on the file's bytes, and the kernel's row lookup on the repacked bytes)
must equal gguf.quants.dequantize exactly. The kernel's product quantizes x per 32-block to int8
(dx = max|x| / 127, round to nearest): with x already on that grid (integers with 127 in every
block) it is exact up to fp32 summation, checked to 1e-6 relative; on random x each product has
a relative error of at most 1/254 of its block's max |x|, so the sums stay within 2% of the max
|output| (measured: under 1%).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.kernels.cpu_quant import cpu_supports_quant, load_cpu_quant
from radixlm.runtime.layers.quant_linear import BLOCK_BYTES, dequantize, quant_weight

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

mod = load_cpu_quant() if cpu_supports_quant() else None
needs_kernel = pytest.mark.skipif(mod is None, reason="needs a CPU with AVX512-VNNI and a C++ compiler")
TYPES = sorted(BLOCK_BYTES)   # the k-quants (no gguf quantizer) are in test_kquant.py


def quantized(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's bytes [n, bytes/row], gguf's dequantization [n, k] fp32) of a random weight."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType(qtype))
    return torch.from_numpy(raw.copy()), torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(qtype)).copy())


@pytest.mark.parametrize("qtype", TYPES)
def test_torch_dequantize_is_exact(qtype):
    raw, ref = quantized(qtype, 37, 96, qtype)
    assert torch.equal(dequantize(raw, qtype), ref)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_row_lookup_is_exact(qtype):
    raw, ref = quantized(qtype, 37, 96, qtype)
    w = quant_weight([(raw, qtype, 37)], 96)
    assert w.parts[0].packed and w.numel() == raw.numel() + (48 - 37) * raw.shape[1]   # 16-row groups
    ids = torch.tensor([0, 36, 5, 5, 17, 16])
    assert torch.equal(w.rows(ids, torch.float32), ref[ids])


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [0, 1, 3, 4, 5, 17])
def test_kernel_exact_on_int8_grid(qtype, m):
    n, k = 45, 160
    raw, ref = quantized(qtype, n, k, qtype + m)
    w = quant_weight([(raw, qtype, n)], k)
    x = torch.randint(-127, 128, (m, k)).float()
    x[:, ::32] = 127
    y = w.linear(x)
    exact = x.double() @ ref.double().T
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= 1e-6 * (x.double().abs() @ ref.double().abs().T) + 1e-9).all()


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_close_on_random_x(qtype, dtype):
    n, k, m = 70, 576, 9
    raw, ref = quantized(qtype, n, k, 3 * qtype)
    w = quant_weight([(raw, qtype, n)], k)
    x = torch.randn(m, k).to(dtype)
    y = w.linear(x)
    exact = x.double() @ ref.double().T
    assert y.dtype == dtype
    assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("packed", [False, True])
def test_fused_shards_of_mixed_types(packed, monkeypatch):
    """A qkv made of Q4_1, Q4_1, Q8_0 shards: two parts, outputs stacked in shard order."""
    if packed and mod is None:
        pytest.skip("needs the kernel")
    if not packed:
        monkeypatch.setattr("radixlm.runtime.layers.quant_linear.load_cpu_quant", lambda: None)
    shards = [quantized(t, rows, 64, i) for i, (t, rows) in enumerate([(3, 32), (3, 16), (8, 16)])]
    w = quant_weight([(raw, t, rows) for (raw, _), (t, rows) in zip(shards, [(3, 32), (3, 16), (8, 16)])], 64)
    assert [p.rows for p in w.parts] == [48, 16] and w.out_features == 64
    ref = torch.cat([r for _, r in shards])
    x = torch.randint(-127, 128, (3, 64)).float()
    x[:, ::32] = 127
    assert torch.allclose(w.linear(x), x @ ref.T, rtol=1e-5, atol=1e-4)
    ids = torch.tensor([63, 0, 47, 48])
    assert torch.equal(w.rows(ids, torch.float32), ref[ids])
