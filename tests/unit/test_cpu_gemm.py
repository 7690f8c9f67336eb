"""kernels/cpu_gemm: the packed bf16 linear against an fp64 reference and F.linear, on the path
this CPU takes (vdpbf16ps on AVX512-BF16, fp32 FMAs on AVX2); on an AVX512 CPU the whole file runs
once more with the AVX2 path forced (test_the_avx2_path_on_an_avx512_cpu)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu_build import cpu_flags, pick_isa
from radixlm.kernels.cpu_gemm import cpu_supports_gemm, load_cpu_gemm
from radixlm.runtime.mem_cache.huge_pages import HUGE_PAGE, huge_page_empty

gemm = load_cpu_gemm() if cpu_supports_gemm() else None
pytestmark = pytest.mark.skipif(gemm is None, reason="needs a CPU with AVX512 or AVX2 and a C++ compiler")


def packed(w: torch.Tensor) -> torch.Tensor:
    out = huge_page_empty(gemm.packed_numel(*w.shape), torch.bfloat16)
    gemm.pack(w, out)
    return out


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits), elementwise."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize("n,k", [(1, 2), (64, 64), (100, 64), (960, 576), (129, 1538), (3000, 96)])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 17, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference_within_one_rounding(n, k, m, with_bias):
    torch.manual_seed(n * 7 + k + m)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    out = gemm.linear(x, packed(w), n, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    # fp32 sums then one rounding to bf16: within one bf16 step of the exact result (plus fp32 slack)
    slack = 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((out.double() - ref).abs() <= bf16_ulp(ref) + slack).all()
    # and within one bf16 step of oneDNN's answer (which rounds its own fp32 sum)
    want = F.linear(x, w, bias)
    assert ((out.float() - want.float()).abs() <= bf16_ulp(want.float()) + slack.float()).all()


@pytest.mark.parametrize("m", [7, 64, 300, 517])
def test_any_thread_count_gives_the_same_bits(m):
    """Threads split each row chunk's (block, row tile) pairs, cutting blocks between threads where
    the block count does not divide (9 blocks here): every output element is still computed once, in
    the same order, whatever the split."""
    torch.manual_seed(m)
    w = torch.randn(576, 96).to(torch.bfloat16)
    gu = (torch.randn(2 * 576, 96) * 0.2).to(torch.bfloat16)
    x = torch.randn(m, 96).to(torch.bfloat16)
    pw, pgu = packed(w), packed(gu)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append((gemm.linear(x, pw, 576, None), gemm.linear_silu_mul(x, pgu, 576)))
    finally:
        torch.set_num_threads(before)
    for lin, fused in outs[1:]:
        assert torch.equal(lin, outs[0][0]) and torch.equal(fused, outs[0][1])
    ref = x.float() @ w.float().T
    torch.testing.assert_close(outs[0][0].float(), ref, atol=0.05, rtol=0.02)


def test_strided_rows_and_tail_rows_are_not_written():
    torch.manual_seed(0)
    w = torch.randn(70, 32).to(torch.bfloat16)
    x = torch.randn(5, 48).to(torch.bfloat16)[:, 8:40]          # row stride 48, last dim contiguous
    out = gemm.linear(x, packed(w), 70, None)
    assert torch.allclose(out.float(), (x.float() @ w.float().T), rtol=1e-2, atol=1e-2)
    # the padded block rows (70..127) are zeros in the packed copy and never reach the output
    p = packed(w).view(2, 16, 64, 2)
    assert (p[1, :, 6:] == 0).all()


def test_bad_shapes_are_refused():
    w = torch.randn(8, 6).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="even"):
        gemm.pack(torch.randn(8, 5).to(torch.bfloat16), torch.empty(gemm.packed_numel(8, 5), dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        gemm.linear(torch.randn(2, 8).to(torch.bfloat16), packed(w), 8, None)
    with pytest.raises(RuntimeError, match="bf16"):
        gemm.linear(torch.randn(2, 6), packed(w), 8, None)


def test_huge_page_arena_is_aligned_and_outlives_its_mapping_reference():
    t = huge_page_empty(3 * 1024 * 1024 + 5, torch.bfloat16)
    assert t.numel() == 3 * 1024 * 1024 + 5 and t.dtype == torch.bfloat16
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.5)
    assert t.float().sum().item() == 1.5 * t.numel()


@pytest.mark.parametrize("i,k", [(64, 64), (128, 96), (1536, 576)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 300])
def test_linear_silu_mul_is_linear_then_silu_and_mul(i, k, m):
    """gemm_silu.h: the fused gate_up + SiLU-and-mul has exactly the bits of the two steps (strided
    rows, row tails of every tile size, more rows than one row chunk)."""
    from radixlm.runtime.layers.activation import SiluAndMul

    torch.manual_seed(i + k + m)
    w = (torch.randn(2 * i, k) * 0.2).to(torch.bfloat16)
    x = torch.randn(m, k + 8).to(torch.bfloat16)[:, 4:4 + k]
    pw = packed(w)
    want = SiluAndMul()(gemm.linear(x, pw, 2 * i, None))
    got = gemm.linear_silu_mul(x, pw, i)
    assert got.shape == (m, i) and torch.equal(got, want)
    # the halves are not swapped or shifted: against the plain torch math, within rounding
    ref = F.silu(x.float() @ w[:i].float().T) * (x.float() @ w[i:].float().T)
    torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=0.05)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        gemm.linear_silu_mul(x, packed(torch.randn(2 * 96, k).to(torch.bfloat16)), 96)


def test_llama_mlp_takes_the_fused_path_only_where_it_applies(monkeypatch):
    """LlamaMLP runs gemm_silu.h when its gate_up weight is in the gemm layout (same output as the
    unfused path), and the projection + SiluAndMul for any other layout."""
    from types import SimpleNamespace

    from radixlm.runtime.layers import packed_linear
    from radixlm.runtime.layers.packed_linear import GemmWeight
    from radixlm.runtime.models.llama import LlamaMLP

    cfg = SimpleNamespace(hidden_act="silu", intermediate_size=128, hidden_size=64)
    torch.manual_seed(0)
    mlp = LlamaMLP(cfg, bias=False).to(torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(7, 64).to(torch.bfloat16)
    want = mlp(x)                                          # plain weights: F.linear + SiluAndMul
    w = mlp.gate_up_proj.weight
    mlp.gate_up_proj.packed_weight = GemmWeight(packed(w.detach()), w.shape[0])
    calls = []
    real = gemm.linear_silu_mul
    monkeypatch.setattr(packed_linear, "load_cpu_gemm", lambda: type("G", (), {
        "linear_silu_mul": staticmethod(lambda *a: calls.append(1) or real(*a)),
        "linear": staticmethod(gemm.linear)})())
    got = mlp(x)
    assert calls == [1]
    torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)


@pytest.mark.skipif(pick_isa() != "avx512" or not {"avx2", "fma"} <= cpu_flags() or "PYTEST_GEMM_AVX2_RUN" in os.environ,
                    reason="this CPU runs the AVX2 path in the tests above already (or this is that run)")
def test_the_avx2_path_on_an_avx512_cpu():
    """The fp32-FMA path that AVX2 CPUs take (gemm.h without __AVX512BF16__), built with
    RADIXLM_CPU_KERNEL_ISA=avx2 and put through this file's tests in a fresh process."""
    env = {**os.environ, "RADIXLM_CPU_KERNEL_ISA": "avx2", "PYTEST_GEMM_AVX2_RUN": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "radixlm_cpu_gemm_avx2" in _gemm_module_name(env)


def _gemm_module_name(env: dict[str, str]) -> str:
    code = "from radixlm.kernels.cpu_gemm import load_cpu_gemm; print(load_cpu_gemm().__name__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
