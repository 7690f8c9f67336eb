"""The prefill side of GGUF weights kept quantized: kernels/cpu_quant/qgemm.h (`gemm`, `dequantize_bf16`)
and runtime/layers/quant_select.py's choice by row count, against dequantize-then-matmul, every type.

Tolerances. gemm quantizes x per row and block of 32 to int8 as the decode kernel does, so it is
compared with int8-rounded x @ W.T (W = gguf's dequantization): both sum the same products, only
the fp32 order differs, 1e-5 relative to sum |w| |x| (measured: under 2e-7). `dequantize_bf16` must
equal gguf's dequantization rounded to bf16 exactly; the dequant path (bf16 tiles through F.linear)
then matches bf16 x @ bf16(W).T up to oneDNN's fp32 sums and the bf16 output, 2^-8 relative to
sum |w| |x|. Rows of x span quant_select's buckets (16, 64, 256) and the edges of the kernel's
tiles (3 rows x 4 groups for the 32-block types, 4 x 2 for the k-quants) and of its row chunks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.kernels.cpu_quant import cpu_supports_quant, load_cpu_quant
from radixlm.runtime.layers import quant_select
from radixlm.runtime.layers.quant_linear import part_linear, quant_weight

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

mod = load_cpu_quant() if cpu_supports_quant() else None
pytestmark = pytest.mark.skipif(mod is None, reason="needs a CPU with AVX512-VNNI and a C++ compiler")
K_BYTES = {12: 144, 13: 176, 14: 210}
K_SCALES = {12: [0, 2], 13: [0, 2], 14: [208]}
TYPES = [2, 3, 6, 7, 8, 12, 13, 14]       # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K


def weight(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's bytes [n, bytes/row], gguf's dequantization [n, k] fp32); k-quants: random valid blocks."""
    rng = np.random.default_rng(seed)
    if qtype in K_BYTES:
        raw = rng.integers(0, 256, size=(n * k // 256, K_BYTES[qtype]), dtype=np.uint8)
        for at in K_SCALES[qtype]:
            raw[:, at:at + 2] = rng.uniform(1e-3, 1e-2, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02).astype(np.float32)
        raw = quants.quantize(w, GGMLQuantizationType(qtype))
    ref = quants.dequantize(raw, GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(np.ascontiguousarray(ref)).float()


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x on the kernel's int8 grid, rounded as it rounds (q = round(x * (127 / amax)), dx = amax / 127)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0))
    return (q * (amax / 127)).reshape(x.shape)


def rel_err(y: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    return ((y.float() - want).abs() / (scale + 1e-30)).max().item()


@pytest.fixture(scope="module", params=TYPES)
def case(request):
    qtype = request.param
    n, k = 83, 512                              # 6 groups: one full tile (or three) and an edge
    raw, ref = weight(qtype, n, k, qtype)
    return qtype, quant_weight([(raw, qtype, n)], k), ref


@pytest.mark.parametrize("m", [1, 15, 16, 64, 200, 800])
def test_gemm_matches_dequantize_then_matmul(case, m):
    qtype, w, ref = case
    p = w.parts[0]
    assert p.packed
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m))
    y = part_linear(p, x, w.in_features, "gemm")
    xr = int8_rounded(x)
    assert y.shape == (m, w.out_features) and y.dtype == torch.float32
    assert rel_err(y, xr @ ref.T, xr.abs() @ ref.abs().T) <= 1e-5
    # the decode kernel computes the same sums: agreement to fp32 rounding
    v = part_linear(p, x, w.in_features, "vnni")
    assert rel_err(y, v, xr.abs() @ ref.abs().T) <= 1e-5


def test_dequantize_bf16_exact(case):
    qtype, w, ref = case
    p = w.parts[0]
    assert torch.equal(mod.dequantize_bf16(p.data, qtype, p.rows, w.in_features, 0, 6), ref.bfloat16())
    assert torch.equal(mod.dequantize_bf16(p.data, qtype, p.rows, w.in_features, 1, 3), ref[16:48].bfloat16())
    with pytest.raises(RuntimeError, match="out of range"):
        mod.dequantize_bf16(p.data, qtype, p.rows, w.in_features, 2, 7)


@pytest.mark.parametrize("m", [3, 70])
def test_dequant_path_matches_bf16_matmul(case, m, monkeypatch):
    qtype, w, ref = case
    monkeypatch.setattr(quant_select, "TILE_BYTES", 2 * 16 * w.in_features * 2)     # 2 groups a tile: 3 tiles
    monkeypatch.setattr("radixlm.runtime.layers.quant_linear.TILE_BYTES", 2 * 16 * w.in_features * 2)
    x = torch.randn(m, w.in_features, generator=torch.Generator().manual_seed(m)).bfloat16()
    y = part_linear(w.parts[0], x, w.in_features, "dequant")
    wb = ref.bfloat16().float()
    assert y.dtype == torch.bfloat16 and y.shape == (m, w.out_features)
    assert rel_err(y, x.float() @ wb.T, x.float().abs() @ wb.abs().T) <= 2 ** -8


def test_linear_follows_the_plan_across_rows(monkeypatch):
    """QuantWeight.linear uses the plan's kernel for each row count, and every kernel gives the product."""
    qtype, n, k = 2, 40, 256
    raw, ref = weight(qtype, n, k, 5)
    w = quant_weight([(raw, qtype, n)], k)
    monkeypatch.setenv("RADIXLM_CPU_QUANT_KERNEL", "auto")
    monkeypatch.setitem(quant_select._plans, (qtype, k, torch.bfloat16), ((16, "gemm"), (64, "dequant"), (256, "gemm")))
    picks = {m: quant_select.kernel_for(qtype, k, torch.bfloat16, m) for m in (1, 15, 16, 63, 64, 255, 256, 999)}
    assert picks == {1: "vnni", 15: "vnni", 16: "gemm", 63: "gemm", 64: "dequant", 255: "dequant", 256: "gemm",
                     999: "gemm"}
    assert quant_select.kernel_for(qtype, k, torch.float32, 100) == "gemm"      # no plan for fp32: DEFAULT
    for m in (15, 16, 64, 256):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = w.linear(x)
        wb = ref.bfloat16().float()
        assert rel_err(y, x.float() @ wb.T, x.float().abs() @ wb.abs().T) <= 2 ** -7   # int8 x or bf16 tiles
    monkeypatch.setenv("RADIXLM_CPU_QUANT_KERNEL", "dequant")
    assert quant_select.kernel_for(qtype, k, torch.bfloat16, 1) == "dequant"
    assert quant_select.kernel_for(qtype, k, torch.float32, 1) == "gemm"


def test_choose_measures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_LINEAR_SELECT_CACHE", str(tmp_path / "sel.json"))
    monkeypatch.setenv("RADIXLM_CPU_QUANT_KERNEL", "auto")
    monkeypatch.setattr(quant_select, "ROWS", (16, 64))
    monkeypatch.setattr(quant_select, "_plans", {})
    raws = [weight(t, 32, 256, t) for t in (2, 12)]
    ws = [quant_weight([(raw, t, 32)], 256) for (raw, _), t in zip(raws, (2, 12))]
    plans = quant_select.choose_quant_kernels(ws, torch.bfloat16)
    assert set(plans) == {(2, 256), (12, 256)}
    for (t, k), plan in plans.items():
        assert [r for r, _ in plan] == [16, 64]
        assert all(kern in quant_select.candidates(torch.bfloat16) for _, kern in plan)
        assert quant_select.kernel_for(t, k, torch.bfloat16, 64) == plan[-1][1]
    assert quant_select.plan_of({"16": {"vnni": 10.0, "gemm": 9.9}, "64": {"vnni": 30, "gemm": 20, "dequant": 25}}) \
        == ((16, "vnni"), (64, "gemm"))
