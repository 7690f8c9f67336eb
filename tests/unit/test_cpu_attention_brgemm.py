"""The brgemm extend kernel (kernels/cpu_attention/extend_brgemm.h) and its selection (extend_select.py).

The kernel runs through the backend with RADIXLM_CPU_EXTEND_KERNEL=brgemm on the batches of
test_cpu_attention.py (real paged pools with gaps, ragged prefixes) and is checked against the same fp32
torch reference; a spy on the extension confirms which kernel ran. Lengths straddle the kernel's
64-row query blocks and 128-key blocks, and the multi-block requests share packed key blocks across
threads. The selection tests fake the timings (and time the real kernels once).
"""

from __future__ import annotations

import json

import pytest
import torch

from radixlm.runtime.layers.attention import extend_select
from radixlm.runtime.layers.attention.base import RadixAttention
from radixlm.runtime.layers.attention.torch_native import TorchNativeAttnBackend
from radixlm.runtime.model_executor.forward_batch import ForwardMode
from tests.unit.test_cpu_attention import EXTEND_LENS, KERNELS, check, literal_window_attention, make_batch, run

pytestmark = pytest.mark.skipif(KERNELS is None, reason="CPU attention kernels unavailable (no AVX2/AVX512 or build failed)")

LONG_LENS = EXTEND_LENS + [(70, 200), (0, 131), (0, 300), (257, 400)]


class Spy:
    """The extension, recording which of its functions were called."""

    def __init__(self, mod):
        self.mod, self.calls = mod, []

    def __getattr__(self, name: str):
        fn = getattr(self.mod, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return call


def spied_backend() -> tuple[TorchNativeAttnBackend, Spy]:
    backend = TorchNativeAttnBackend()
    spy = Spy(KERNELS)
    backend.kernels = spy
    return backend, spy


@pytest.fixture
def forced(monkeypatch):
    def force(kernel: str) -> None:
        monkeypatch.setenv("RADIXLM_CPU_EXTEND_KERNEL", kernel)
    return force


# The micro-kernels of the block products this CPU runs: the best one (amx, avx512_bf16) and torch's
# gemm fallback; every kernel test below runs on each in turn.
MICROS = sorted({KERNELS.extend_brgemm_micro(), "gemm"}) if KERNELS is not None else []


@pytest.fixture(params=MICROS)
def micro(request):
    KERNELS.force_extend_brgemm_micro(request.param)
    assert KERNELS.extend_brgemm_micro() == request.param
    yield request.param
    KERNELS.force_extend_brgemm_micro("auto")


def test_best_micro_kernel_follows_the_cpu():
    """AMX where oneDNN's brgemm packs for it, else vdpbf16ps on an AVX512-BF16 build: a CPU that has
    either never runs the plain gemm fallback (2-4x slower at prefill)."""
    flags = extend_select.cpu_attention.cpu_flags()
    best = KERNELS.extend_brgemm_micro()
    if torch.cpu._is_amx_tile_supported():
        assert best == "amx"
    elif "avx512_bf16" in flags and KERNELS.isa() == "avx512":
        assert best == "avx512_bf16"
    else:
        assert best == "gemm"
    with pytest.raises(RuntimeError, match="does not run here"):
        KERNELS.force_extend_brgemm_micro("amx" if best != "amx" else "avx512_bf16")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_brgemm_extend_matches_reference(forced, micro, page_size, heads, kv_heads, head_dim):
    forced("brgemm")
    fb, q = make_batch(LONG_LENS, page_size, heads, kv_heads, head_dim, torch.bfloat16, seed=heads + page_size,
                       mode=ForwardMode.EXTEND)
    layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5)
    backend, spy = spied_backend()
    check(fb, q, layer, run(fb, q, layer, backend))
    assert spy.calls == ["extend_brgemm"]


@pytest.mark.parametrize("window", [0, 1, 31, 47, 100, 200])
def test_brgemm_sliding_window(forced, micro, window):
    forced("brgemm")
    heads, kv_heads, head_dim = 8, 2, 64
    fb, q = make_batch(LONG_LENS, 16, heads, kv_heads, head_dim, torch.bfloat16, seed=window, mode=ForwardMode.EXTEND)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.125, sliding_window_size=window)
    backend, spy = spied_backend()
    out = run(fb, q, layer, backend)
    check(fb, q, layer, out)
    torch.testing.assert_close(out.float(), literal_window_attention(fb, q, layer), atol=1e-2, rtol=1e-2)
    assert spy.calls == ["extend_brgemm"]


@pytest.mark.parametrize("window", [-1, 31])
def test_brgemm_logit_cap(forced, micro, window):
    forced("brgemm")
    heads, kv_heads, head_dim = 8, 2, 64
    fb, q = make_batch(LONG_LENS, 1, heads, kv_heads, head_dim, torch.bfloat16, seed=5, mode=ForwardMode.EXTEND)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.3, sliding_window_size=window, logit_cap=1.5)
    backend, spy = spied_backend()
    check(fb, q, layer, run(fb, q, layer, backend))
    assert spy.calls == ["extend_brgemm"]


def test_brgemm_strided_q_and_small_head_dim(forced, micro):
    """q as a view of a fused qkv output (rows 2x apart), head_dim 16 as in the tiny test models."""
    forced("brgemm")
    heads, kv_heads, head_dim = 4, 2, 16
    fb, q = make_batch([(0, 90), (3, 40)], 1, heads, kv_heads, head_dim, torch.bfloat16, seed=3, mode=ForwardMode.EXTEND)
    qkv = torch.randn(q.shape[0], (heads + 2 * kv_heads) * head_dim).bfloat16()
    qv = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    qv.copy_(q)
    layer = RadixAttention(0, heads, kv_heads, head_dim, 0.25)
    backend, spy = spied_backend()
    check(fb, qv, layer, run(fb, qv, layer, backend))
    assert spy.calls == ["extend_brgemm"]


@pytest.mark.parametrize("window", [-1, 150])
def test_brgemm_prefix_slots_shared_across_requests(forced, micro, window):
    """Requests whose prefixes are the same KV slots (a radix-cache hit): the kernel packs such key
    blocks once for all of them (SharedBlocks). Shares of whole blocks, of part of a block (the rest
    differs: not shared), with a multi-block request, and with the same length but other slots."""
    forced("brgemm")
    heads, kv_heads, head_dim = 9, 3, 64
    lens = [(300, 340), (300, 364), (300, 340), (200, 330), (128, 300), (300, 301), (0, 90)]
    shared = [300, 300, 300, 200, 128, 300, 0]          # leading slots taken from request 0's row
    fb, q = make_batch(lens, 1, heads, kv_heads, head_dim, torch.bfloat16, seed=11, mode=ForwardMode.EXTEND)
    table, rows = fb.req_to_token_pool.req_to_token, fb.req_pool_indices.tolist()
    for row, n in zip(rows[1:], shared[1:]):
        table[row, :n] = table[rows[0], :n]
    layer = RadixAttention(0, heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window_size=window)
    backend, spy = spied_backend()
    check(fb, q, layer, run(fb, q, layer, backend))
    assert spy.calls == ["extend_brgemm"]


def test_fp32_and_decode_stay_on_simd(forced):
    """Forced brgemm still leaves fp32 extends and decode batches to the simd kernels."""
    forced("brgemm")
    layer = RadixAttention(0, 8, 2, 64, 0.125)
    fb, q = make_batch(EXTEND_LENS, 16, 8, 2, 64, torch.float32, seed=1, mode=ForwardMode.EXTEND)
    backend, spy = spied_backend()
    check(fb, q, layer, run(fb, q, layer, backend))
    fb, q = make_batch([(s - 1, s) for s in (5, 70)], 16, 8, 2, 64, torch.bfloat16, seed=1, mode=ForwardMode.DECODE)
    check(fb, q, layer, run(fb, q, layer, backend))
    assert spy.calls == ["extend", "decode"]


# ----------------------------------------------------------------- selection
@pytest.fixture
def fresh_selection(monkeypatch, tmp_path):
    """auto mode, an empty cache file in tmp_path, no choices made yet in this process."""
    monkeypatch.setenv("RADIXLM_CPU_EXTEND_KERNEL", "auto")
    monkeypatch.setenv("RADIXLM_LINEAR_SELECT_CACHE", str(tmp_path / "select.json"))
    monkeypatch.setattr(extend_select, "_choices", {})
    monkeypatch.setattr(extend_select, "NOISY", {})
    return tmp_path / "select.json"


def fake_times(monkeypatch, times: dict[str, float], quiet: bool = True) -> list:
    calls = []

    def measure(kernels, *shape):
        calls.append(shape)
        return dict(times), quiet
    monkeypatch.setattr(extend_select, "measure", measure)
    return calls


@pytest.mark.parametrize("times,want", [({"simd": 900.0, "brgemm": 300.0}, "brgemm"),
                                        ({"simd": 300.0, "brgemm": 900.0}, "simd"),
                                        ({"simd": 300.0, "brgemm": 295.0}, "simd")])   # a tie goes to simd
def test_auto_picks_the_faster_and_caches_it(fresh_selection, monkeypatch, times, want):
    calls = fake_times(monkeypatch, times)
    assert extend_select.choose(KERNELS, 9, 3, 64) == want
    assert extend_select.choose(KERNELS, 9, 3, 64) == want and calls == [(9, 3, 64)]   # once per process
    entries = json.loads(fresh_selection.read_text())["entries"]
    assert list(entries.values()) == [times] and "heads=9/3|d=64" in next(iter(entries))
    monkeypatch.setattr(extend_select, "_choices", {})            # a later process: from the file
    assert extend_select.choose(KERNELS, 9, 3, 64) == want and len(calls) == 1
    assert extend_select.last_choice().how == "cached"


def test_busy_timing_is_not_cached(fresh_selection, monkeypatch):
    fake_times(monkeypatch, {"simd": 900.0, "brgemm": 300.0}, quiet=False)
    assert extend_select.choose(KERNELS, 9, 3, 64) == "brgemm"
    assert not fresh_selection.exists()
    assert "busy" in extend_select.last_choice().summary()


def test_runs_cut_a_mixed_batch_by_kind(fresh_selection, monkeypatch):
    fake_times(monkeypatch, {"simd": 900.0, "brgemm": 300.0})
    m = extend_select.MIN_ROWS
    assert extend_select.runs([1, 1, 1, m - 1, 4, m, 300, 1]) == [(0, 3, "decode"), (3, 5, "short"), (5, 7, "long"),
                                                                   (7, 8, "decode")]
    layer = RadixAttention(0, 9, 3, 64, 0.125)
    bf16 = (torch.bfloat16, torch.bfloat16)
    assert [extend_select.kernel_for(KERNELS, layer, k, *bf16) for k in ("decode", "short", "long")] == [
        "decode", "simd", "brgemm"]
    assert extend_select.kernel_for(KERNELS, layer, "long", torch.float32, torch.float32) == "simd"
    monkeypatch.setenv("RADIXLM_CPU_EXTEND_KERNEL", "simd")
    assert extend_select.runs([1, 300]) == [(0, 2, "any")]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("winner", ["brgemm", "simd"])
def test_mixed_batch_runs_one_kernel_per_run(fresh_selection, monkeypatch, page_size, winner):
    """auto mode on a mixed batch (decodes first, as the planner builds it, then a short and long
    extends; and an interleaved one): one call per run, each run's kernel, output as the reference."""
    fake_times(monkeypatch, {"simd": 900.0, "brgemm": 300.0} if winner == "brgemm" else {"simd": 1.0, "brgemm": 9.0})
    layer = RadixAttention(0, 8, 2, 64, 0.125)
    long = "extend_brgemm" if winner == "brgemm" else "extend"
    for lens, calls in [([(40, 41), (7, 8), (99, 100), (10, 14), (0, 200), (64, 130)], ["decode", "extend", long]),
                        (EXTEND_LENS, ["extend", long, "decode", long, "decode", long, "decode"])]:
        fb, q = make_batch(lens, page_size, 8, 2, 64, torch.bfloat16, seed=7, mode=ForwardMode.EXTEND)
        backend, spy = spied_backend()
        check(fb, q, layer, run(fb, q, layer, backend))
        assert spy.calls == calls


@pytest.mark.parametrize("kernel", ["brgemm", "simd"])
def test_forced_kernel_is_used_without_timing(fresh_selection, monkeypatch, kernel):
    monkeypatch.setenv("RADIXLM_CPU_EXTEND_KERNEL", kernel)
    calls = fake_times(monkeypatch, {"simd": 1.0, "brgemm": 2.0})
    layer = RadixAttention(0, 9, 3, 64, 0.125)
    assert extend_select.kernel_for(KERNELS, layer, "any", torch.bfloat16, torch.bfloat16) == kernel
    assert extend_select.choose(KERNELS, 9, 3, 64) == kernel and calls == []
    assert extend_select.last_choice().summary() == f"{kernel} (forced by --cpu-extend-kernel {kernel})"
    # through the backend: a bf16 extend runs the forced kernel
    fb, q = make_batch([(0, 20), (5, 9)], 1, 9, 3, 64, torch.bfloat16, seed=2, mode=ForwardMode.EXTEND)
    backend, spy = spied_backend()
    check(fb, q, layer, run(fb, q, layer, backend))
    assert spy.calls == ["extend_brgemm" if kernel == "brgemm" else "extend"]


def test_backend_with_a_bf16_shape_chooses_at_creation(fresh_selection, monkeypatch):
    calls = fake_times(monkeypatch, {"simd": 900.0, "brgemm": 300.0})
    TorchNativeAttnBackend(num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    TorchNativeAttnBackend(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32)   # fp32: nothing to time
    assert calls == [(9, 3, 64)]


def test_real_timing_of_both_kernels(monkeypatch):
    """measure() runs both real kernels on the representative extend and returns µs for each."""
    monkeypatch.setattr(extend_select, "MAX_PASSES", 3)
    times, _ = extend_select.measure(KERNELS, 4, 2, 64)
    assert set(times) == {"simd", "brgemm"} and all(0 < t < 5e6 for t in times.values())


# ----------------------------------------------------------------- a model in bf16
def test_bf16_tiny_model_brgemm_as_close_to_hf_as_simd(llama_path, monkeypatch):
    """The tiny Llama in bf16, prefill + an extend over its cached prefix, with each extend kernel
    forced: brgemm's logits are as close to HF's fp32 logits as the simd kernel's."""
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.models.model_config import ModelConfig
    from radixlm.runtime.models.weight_loader import load_model
    from tests.unit.test_models_vs_hf import PagedRunner, hf_logits, random_prompts

    config = ModelConfig.from_path(llama_path, dtype="bfloat16")
    model = load_model(config, "cpu", show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    (ids,) = random_prompts(config.vocab_size, [120], seed=4)
    want = hf_logits(hf, ids)
    errors = {}
    for kernel in ("simd", "brgemm"):
        monkeypatch.setenv("RADIXLM_CPU_EXTEND_KERNEL", kernel)
        runner = PagedRunner(model, config, page_size=16, num_pages=32)
        spy = runner.backend.kernels = Spy(KERNELS)
        # region table: [0, 80) prefill | [80, 120) extend over the cached prefix
        ours = torch.cat([runner.extend([0], [0], [ids[:80]]), runner.extend([0], [80], [ids[80:]])])
        errors[kernel] = (ours.float() - want).abs().max().item()
        assert set(spy.calls) == {"extend_brgemm" if kernel == "brgemm" else "extend"}
    assert errors["brgemm"] <= 1.5 * errors["simd"] + 1e-2, errors
