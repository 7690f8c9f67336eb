"""CPU linear kernels chosen by measurement (runtime/layers/linear_select.py) and the AMX tile
permission (kernels/cpu_amx.py): with the choice forced to each candidate this CPU runs, the
layers' outputs match an fp32 F.linear reference within bf16 rounding; the winner rule; the cache
file round-trips and a cached choice is used without timing; the AMX-refusal fallback caps oneDNN
(checked in a fresh process through oneDNN's own verbose report)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels import cpu_amx, cpu_gemm
from radixlm.runtime.layers import linear_select as ls
from radixlm.runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixlm.runtime.layers.packed_linear import GemmWeight, onednn_supported, pack_linear_weights, packing_supported
from radixlm.runtime.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

BF16_OK = packing_supported(torch.empty(2, 2, dtype=torch.bfloat16))
ONEDNN_BF16 = onednn_supported(torch.empty(2, 2, dtype=torch.bfloat16))   # not on AVX2 CPUs
KERNELS = [k for k in ls.CANDIDATES if (k != "gemm" or cpu_gemm.cpu_supports_gemm()) and (k != "onednn" or ONEDNN_BF16)]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test reads and writes its own selection cache file."""
    monkeypatch.setenv("RADIXLM_LINEAR_SELECT_CACHE", str(tmp_path / "linear_select.json"))
    monkeypatch.delenv("RADIXLM_CPU_LINEAR_KERNEL", raising=False)
    cpu_gemm.load_cpu_gemm.cache_clear()
    yield
    cpu_gemm.load_cpu_gemm.cache_clear()


class Block(torch.nn.Module):
    """Every kind of packed layer: merged column (with bias), row, untied and tied LM heads; one
    odd in_features (the gemm layout needs it even, so a forced gemm falls back to oneDNN)."""

    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(300, 64)
        self.up = MergedColumnParallelLinear(64, [96, 96], bias=True)
        self.down = RowParallelLinear(192, 64)
        self.odd = RowParallelLinear(63, 64)
        self.head = ParallelLMHead(300, 64, tied_to=self.embed)
        self.untied_head = ParallelLMHead(300, 64)


def make_block() -> Block:
    torch.manual_seed(0)
    block = Block()
    for p in block.parameters():
        p.data = (torch.randn(p.shape) * 0.1).to(torch.bfloat16)
    return block


def close_to_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """|got - ref| <= 2^-8 |ref| (the output's bf16 rounding) + 2^-12 (|x| @ |w|^T) (fp32 sums in
    another order), with ref = F.linear in fp32 on the same bf16 inputs."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    scale = F.linear(x.float().abs(), w.float().abs())
    return bool(((got.float() - ref).abs() <= ref.abs() * 2 ** -8 + scale * 2 ** -12 + 1e-6).all())


@pytest.mark.skipif(not BF16_OK, reason="no packed bf16 layout on this CPU")
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_forced_kernel_matches_fp32_reference(kernel, rows, monkeypatch):
    monkeypatch.setenv("RADIXLM_CPU_LINEAR_KERNEL", kernel)
    block = make_block()
    dense = {n: p.detach().clone() for n, p in block.named_parameters()}
    pack_linear_weights(block)
    sel = ls.last_selection()
    assert sel.mode == kernel and sel.measured == 0
    want_odd = ls.forced(kernel, ls.candidates(dense["odd.weight"], None))   # onednn, or torch on AVX2
    assert block.up.linear_kernel == kernel and block.odd.linear_kernel == want_odd
    assert isinstance(block.up.packed_weight, GemmWeight) == (kernel == "gemm")
    assert (block.up.packed_weight is None) == (kernel == "torch")
    x, h, o = (torch.randn(rows, n).to(torch.bfloat16) for n in (64, 192, 63))
    with torch.inference_mode():
        assert close_to_fp32(block.up(x), x, dense["up.weight"], dense["up.bias"])
        assert close_to_fp32(block.down(h), h, dense["down.weight"], None)
        assert close_to_fp32(block.odd(o), o, dense["odd.weight"], None)
        assert close_to_fp32(block.head(x), x, dense["embed.weight"], None)
        assert close_to_fp32(block.untied_head(x), x, dense["untied_head.weight"], None)
    assert pack_linear_weights(block) == 0                  # decided once: packing twice is a no-op


def times(rows_to_winner: dict[int, str], kernels: tuple[str, ...] = ("gemm", "onednn", "torch"),
          factor: float = 2.0) -> dict[str, dict[str, float]]:
    """Synthetic times: the named winner takes 100 µs in its bucket, the others 100 * factor."""
    return {str(r): {k: 100.0 if k == w else 100.0 * factor for k in kernels} for r, w in rows_to_winner.items()}


def test_pick_weighs_decode_and_prefill_alike_and_prefers_gemm_on_ties():
    allowed = ["gemm", "onednn", "torch"]
    decode_gemm = {1: "gemm", 4: "gemm", 16: "gemm", 64: "gemm"}
    assert ls.pick(times({**decode_gemm, 256: "gemm"}), allowed) == "gemm"
    # gemm 2x faster at every decode batch, oneDNN 3x faster at prefill: 0.5*1+0.5*3 > 0.5*2+0.5*1
    t = times({**decode_gemm, 256: "onednn"}, factor=2.0)
    t["256"]["gemm"] = 300.0
    assert ls.pick(t, allowed) == "onednn"
    # oneDNN 1.7x faster at 16 and 64 rows, 1.1x slower at 1 and 4, 3x at prefill (an AMX Xeon)
    amx = {"1": {"gemm": 100, "onednn": 110}, "4": {"gemm": 100, "onednn": 110},
           "16": {"gemm": 170, "onednn": 100}, "64": {"gemm": 170, "onednn": 100},
           "256": {"gemm": 300, "onednn": 100}}
    assert ls.pick(amx, ["gemm", "onednn"]) == "onednn"
    even = {"1": {"gemm": 101, "onednn": 100}, "256": {"gemm": 100, "onednn": 101}}
    assert ls.pick(even, ["gemm", "onednn"]) == "gemm"            # within TIE: the earlier one
    assert ls.pick(times({1: "torch", 4: "torch"}), allowed) == "torch"   # LM head: decode rows only


def test_forced_falls_back_along_the_order():
    assert ls.forced("gemm", ["onednn", "torch"]) == "onednn"
    assert ls.forced("onednn", ["torch"]) == "torch"
    assert ls.forced("torch", ["gemm", "onednn", "torch"]) == "torch"


def test_cache_file_round_trips_and_merges(tmp_path):
    path = tmp_path / "sub" / "cache.json"
    ls.save_cache(path, {"a": times({1: "gemm"})})
    ls.save_cache(path, {"b": times({1: "torch"})})
    assert ls.load_cache(path) == {"a": times({1: "gemm"}), "b": times({1: "torch"})}
    assert json.loads(path.read_text())["version"] == ls.CACHE_VERSION
    path.write_text("{not json")
    assert ls.load_cache(path) == {}
    path.write_text(json.dumps({"version": ls.CACHE_VERSION + 1, "entries": {"a": {}}}))
    assert ls.load_cache(path) == {}


@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bf16 matmul on this CPU")
def test_auto_uses_cached_times_without_timing(monkeypatch):
    """Cached times that make each shape's winner known: auto mode follows them and measures nothing."""
    block = make_block()
    modules = [block.up, block.down, block.odd, block.untied_head]
    want = {"up": "torch", "down": "onednn", "odd": "torch", "untied_head": "onednn"}
    entries = {}
    for name, m in zip(want, modules):
        shape = ls.shape_of(m)
        entries[f"{ls.machine_key()}|{shape.key}"] = times({r: want[name] for r in shape.rows})
    ls.save_cache(ls.cache_file(), entries)
    monkeypatch.setattr(ls, "measure", lambda *a, **k: pytest.fail("timed a cached shape"))
    pack_linear_weights(block)
    assert {n: getattr(block, n).linear_kernel for n in want} == want
    assert block.up.packed_weight is None and block.down.packed_weight is not None
    assert ls.last_selection().measured == 0 and "from the cache" in ls.last_selection().summary()


@pytest.mark.skipif(not BF16_OK, reason="no packed bf16 layout on this CPU")
def test_auto_caches_only_quiet_measurements(monkeypatch):
    block = make_block()
    quiet = {"value": False}
    real_measure = ls.measure

    def fake_measure(shape, weight, bias, kernels_, deadline):
        got, _ = real_measure(shape, weight, bias, kernels_, deadline)
        assert set(got) == {str(r) for r in shape.rows}
        assert all(set(v) == set(kernels_) and min(v.values()) > 0 for v in got.values())
        return got, quiet["value"]

    monkeypatch.setattr(ls, "PASSES", 1)
    monkeypatch.setattr(ls, "measure", fake_measure)
    monkeypatch.setattr(ls, "NOISY", {})
    pack_linear_weights(block)
    assert ls.last_selection().busy == 4 and ls.load_cache(ls.cache_file()) == {}
    first = dict(ls.last_selection().choices)
    pack_linear_weights(make_block())            # same process: the noisy times are reused, not retimed,
    assert ls.last_selection().measured == 0 and ls.last_selection().choices == first   # so both agree
    assert ls.load_cache(ls.cache_file()) == {}
    monkeypatch.setattr(ls, "NOISY", {})         # a new process
    quiet["value"] = True
    pack_linear_weights(make_block())
    assert len(ls.load_cache(ls.cache_file())) == 4 and ls.last_selection().measured == 4


def refusing_syscall(*args):
    assert args[1] == cpu_amx.ARCH_REQ_XCOMP_PERM and args[2] == cpu_amx.XFEATURE_XTILEDATA
    return -1, 1                                            # EPERM


def test_amx_refusal_caps_onednn_and_grant_does_not(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    status = cpu_amx.check_amx(avx512 | {"amx_tile"}, refusing_syscall)
    assert not status.granted and status.onednn_cap == "AVX512_CORE_BF16"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16" and "refused" in status.text
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")       # the user's own cap is left alone
    assert cpu_amx.check_amx(avx512 | {"amx_tile"}, refusing_syscall).onednn_cap is None
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert cpu_amx.check_amx(avx512 | {"amx_tile"}, lambda *a: (0, 0)).granted
    assert cpu_amx.check_amx(avx512, lambda *a: pytest.fail("asked without AMX")).text == "not on this CPU"
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ
    assert cpu_amx.non_amx_isa({"avx2", "fma"}) == "AVX2"


def test_real_arch_prctl_reads_this_process_permissions():
    """The ctypes syscall path is real: ARCH_GET_XCOMP_PERM reports x87 and SSE (bits 0, 1) as permitted."""
    mask = ctypes.c_uint64(0)
    ret, err = cpu_amx._libc_syscall(cpu_amx.SYS_ARCH_PRCTL, cpu_amx.ARCH_GET_XCOMP_PERM, ctypes.addressof(mask))
    assert ret == 0, err
    assert mask.value & 0b11 == 0b11


REFUSED_CHILD = """
import torch
from radixlm.kernels import cpu_amx
flags = {"amx_tile", "avx512f", "avx512bw", "avx512vl", "avx512dq"}     # AMX advertised, no AVX512-BF16
status = cpu_amx.check_amx(flags, lambda *a: (-1, 1))
print("cap", status.onednn_cap, flush=True)
torch.backends.mkldnn.verbose(1)
w, x = torch.randn(64, 64).bfloat16(), torch.randn(4, 64).bfloat16()
p = torch.ops.mkldnn._reorder_linear_weight(w, 1)
torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
"""


@pytest.mark.skipif(not ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_amx.cpu_flags()),
                    reason="needs AVX512 to see the cap below this CPU's best ISA")
def test_refusal_cap_reaches_onednn_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", REFUSED_CHILD], env={**env, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "cap AVX512_CORE" in out
    isa = [line for line in out.splitlines() if ",isa:" in line]
    assert isa and "AVX512BW, AVX512VL, and AVX512DQ" in isa[0] and "AMX" not in isa[0]


def test_budget_times_the_most_read_weights_first_and_untimed_follow_the_winners(monkeypatch):
    """With time for one shape only, the one a step reads most (count x size) is timed, and the
    others take what won it, not a fixed default (the LM head was once left untimed on gemm,
    4x slower than oneDNN's AMX kernel at 16 rows)."""
    block = make_block()
    modules = [block.down, block.odd, block.untied_head, block.up]
    timed: list[str] = []

    def fake_measure(shape, weight, bias, kernels_, deadline):
        timed.append(shape.key)
        monkeypatch.setattr(ls, "MEASURE_BUDGET_S", -1.0)      # the budget is gone after this shape
        return times({r: "torch" for r in shape.rows}), True

    monkeypatch.setattr(ls, "measure", fake_measure)
    chosen = ls.choose_kernels(modules)
    biggest = max(modules, key=lambda m: m.weight.numel())
    assert timed == [ls.shape_of(biggest).key]
    assert all(chosen[id(m)] == "torch" for m in modules)
