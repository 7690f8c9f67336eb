"""The one-call CPU decoder (kernels/cpu_decoder, runtime/model_executor/cpu_decoder.py) computes
exactly what the Python forward computes: the same hidden states and the same K/V writes, bit for
bit, on the tiny Llama, Qwen2 (qkv bias) and Qwen3 (per-head q/k norms) in fp32 (dense weights,
at::linear) and bf16 (the packed AVX512-BF16 gemm layout where the CPU has it), over a ragged batch
whose requests sit at different lengths and in scattered KV slots; and in bf16 with the weights in
oneDNN's packed layout (CPUs without AVX512-BF16); and the MoE models (Qwen2-MoE with its shared
expert and a dense layer, Qwen3-MoE, Mixtral) in bf16, whose sparse layers run SparseMoeBlock's fused
path (router, softmax, top-k, kernels/cpu_moe) in C++. Greedy agreement with HF goes
through the scheduler tests (test_models_vs_hf), which run this decoder by default."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.cpu_decoder import load_cpu_decoder
from radixlm.runtime.layers import packed_linear
from radixlm.runtime.layers.quant_linear import QuantWeight
from radixlm.runtime.mem_cache.kv_manager import KVManager
from radixlm.runtime.model_executor.compiled_decode import CompiledDecode
from radixlm.runtime.model_executor.cpu_decoder import CpuDecoder
from radixlm.runtime.model_executor.forward_batch import ForwardMode
from radixlm.runtime.model_executor.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs

pytestmark = pytest.mark.skipif(load_cpu_decoder() is None, reason="C++ decoder unavailable on this machine")


class _Req:
    """The fields KVManager reads and writes."""

    def __init__(self, ids: list[int]):
        self.all_ids = ids
        self.req_pool_idx = None
        self.kv_committed_len = 0
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None


def _runner(path: str, dtype: str, **kwargs) -> ModelRunner:
    args = ServerArgs.from_kwargs(**{"model_path": path, "device": "cpu", "dtype": dtype, "max_total_tokens": 4096,
                                     "max_running_requests": 8, "page_size": 4, **kwargs}).resolved()
    return ModelRunner(args)


def _prefilled_batch(runner: ModelRunner, lengths: list[int]):
    """Prefills requests of `lengths` random tokens (after a throwaway request, so slots are not
    0..n in order) and returns (kv manager, reqs, next token ids)."""
    kv = KVManager(runner.num_pages, runner.page_size, runner.max_running_requests, runner.context_len,
                   runner.device, disable_radix_cache=True)
    gen = torch.Generator().manual_seed(7)
    vocab = runner.model_config.vocab_size
    filler = _Req([1] * 9)
    kv.admit(filler, kv.match_prefix([]))
    kv.alloc_extend([filler], [9])
    reqs = [_Req(torch.randint(3, vocab, (n,), generator=gen).tolist()) for n in lengths]
    for r in reqs:
        assert kv.admit(r, kv.match_prefix([]))
    loc = kv.alloc_extend(reqs, lengths)
    for r in reqs:
        r.kv_committed_len = len(r.all_ids)
    fb = runner.make_forward_batch(ForwardMode.EXTEND, [t for r in reqs for t in r.all_ids],
                                   [r.req_pool_idx for r in reqs], [0] * len(reqs), lengths, loc,
                                   kv.req_to_token_pool)
    next_ids = runner.forward(fb).next_token_logits.argmax(-1).tolist()
    return kv, reqs, next_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-onednn", "bfloat16-gguf-q4_1",
                                   "bfloat16-gguf-q4_k_m"])
def test_decoder_equals_python_forward(tiny_model_path: str, dtype: str, monkeypatch: pytest.MonkeyPatch,
                                       tmp_path, request: pytest.FixtureRequest) -> None:
    """bfloat16-onednn: the weights in oneDNN's packed layout, as where timing picks it.
    bfloat16-gguf-q4_1: a tiny Llama GGUF file in Q4_1 (tests/unit/test_gguf_quant.py), its
    weights kept quantized (kernels/cpu_quant's layout). bfloat16-gguf-q4_k_m: the Q4_K_M-style file
    of tests/unit/test_gguf_kquant.py (k-quants, fused layers mixing GGUF types)."""
    onednn = dtype == "bfloat16-onednn"
    if onednn and not packed_linear.onednn_supported(torch.empty(2, 2, dtype=torch.bfloat16)):
        pytest.skip("oneDNN has no bf16 matmul on this CPU (AVX2): the gemm layout is the only packed one")
    if onednn:
        monkeypatch.setattr(packed_linear, "load_cpu_gemm", lambda: None)
        monkeypatch.setenv("RADIXLM_CPU_LINEAR_KERNEL", "onednn")
    if "gguf" in dtype:
        from tests.real_model import smollm2_gguf
        from tests.unit.test_gguf_kquant import write_q4_k_m_gguf
        from tests.unit.test_gguf_quant import write_tiny_gguf

        if not load_cpu_decoder().with_quant:
            pytest.skip("decoder built without the quantized kernel (no AVX512-VNNI)")
        if tiny_model_path != next(iter(request.getfixturevalue("tiny_models").values())):
            pytest.skip("the GGUF case writes its own Llama: run it once, with the first tiny model")
        write = write_q4_k_m_gguf if dtype.endswith("q4_k_m") else lambda p, **kw: write_tiny_gguf(p, 3, True, **kw)
        tiny_model_path = str(write(tmp_path, tokenizer_from=smollm2_gguf())[0])
    runner = _runner(tiny_model_path, "bfloat16" if onednn or "gguf" in dtype else dtype)
    if "gguf" in dtype:
        assert runner.model.model.layers[0].mlp.down_proj.packed_weight.parts[0].packed
        if dtype.endswith("q4_k_m"):
            assert len(runner.model.model.layers[0].self_attn.qkv_proj.packed_weight.parts) == 2
    if onednn:
        packed = runner.model.model.layers[0].mlp.down_proj.packed_weight
        assert packed is not None and not isinstance(packed, packed_linear.GemmWeight)
    assert_decoder_matches_python_forward(runner)


def test_split_decode_steps_equal_whole_ones(llama_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoder.forward_split (one run of requests per thread, each through every layer alone) gives
    forward()'s hidden states and K/V writes bit for bit, for 2 and 3 parts and for more parts than
    requests; with --cpu-decode-split on, a step through CpuDecoder is split and equal too."""
    monkeypatch.setenv("RADIXLM_CPU_DECODE_SPLIT", "on")
    runner = _runner(llama_path, "bfloat16", max_running_requests=20)
    decoder = runner.decode_forward
    assert isinstance(decoder, CpuDecoder)
    gemm = isinstance(runner.model.model.layers[0].mlp.down_proj.packed_weight, packed_linear.GemmWeight)
    assert decoder.split.mode == ("on" if gemm else "off")
    kv, reqs, ids = _prefilled_batch(runner, [3 + 5 * i for i in range(17)])
    seqs = [r.kv_committed_len for r in reqs]
    loc = kv.alloc_extend(reqs, [1] * len(reqs))
    fb = runner.make_forward_batch(ForwardMode.DECODE, ids, [r.req_pool_idx for r in reqs], seqs,
                                   [s + 1 for s in seqs], loc, kv.req_to_token_pool)
    runner.attn_backend.init_forward_metadata(fb)
    run = fb.attn_metadata.runs[0]
    cache = list(zip(runner.kv_cache.k_buffer, runner.kv_cache.v_buffer))

    def args():   # the embeddings afresh: the decoder adds into its residual input in place
        return (decoder.embed(fb.input_ids), fb.positions, fb.out_cache_loc, kv.req_to_token_pool.req_to_token,
                run.req_pool_indices, run.seq_lens)

    with torch.inference_mode():
        want = decoder.impl.forward(*args())
        want_kv = [(k[loc].clone(), v[loc].clone()) for k, v in cache]
        for parts in (2, 3, 40, "CpuDecoder"):
            for k, v in cache:
                k[loc], v[loc] = 0, 0
            got = decoder(fb) if parts == "CpuDecoder" else decoder.impl.forward_split(*args(), parts)
            assert torch.equal(got, want), parts
            for layer, (k, v) in enumerate(cache):
                assert torch.equal(k[loc], want_kv[layer][0]) and torch.equal(v[loc], want_kv[layer][1]), (parts, layer)


def assert_decoder_matches_python_forward(runner, steps: int = 3) -> None:
    """`steps` greedy decode steps of three prefilled requests: the one-call decoder gives the Python
    forward's hidden states bit for bit and writes the same K/V (zeroed before each decoder call);
    then a mixed pass through `extend` (assert_extend_matches_python_forward)."""
    decoder = runner.decode_forward
    assert isinstance(decoder, CpuDecoder)
    python_forward = CompiledDecode(runner.model, False)
    kv, reqs, ids = _prefilled_batch(runner, [5, 17, 33])
    with torch.inference_mode():
        for _ in range(steps):
            seqs = [r.kv_committed_len for r in reqs]
            loc = kv.alloc_extend(reqs, [1] * len(reqs))
            for r in reqs:
                r.kv_committed_len += 1
            fb = runner.make_forward_batch(ForwardMode.DECODE, ids, [r.req_pool_idx for r in reqs], seqs,
                                           [s + 1 for s in seqs], loc, kv.req_to_token_pool)
            runner.attn_backend.init_forward_metadata(fb)
            want = python_forward(fb)
            cache = list(zip(runner.kv_cache.k_buffer, runner.kv_cache.v_buffer))
            want_kv = [(k[loc].clone(), v[loc].clone()) for k, v in cache]
            for k, v in cache:                          # the decoder must write them again
                k[loc], v[loc] = 0, 0
            got = decoder(fb)
            assert got.dtype == want.dtype and torch.equal(got, want)
            for layer, (k, v) in enumerate(cache):
                assert torch.equal(k[loc], want_kv[layer][0]), f"K of layer {layer}"
                assert torch.equal(v[loc], want_kv[layer][1]), f"V of layer {layer}"
            ids = runner.model.compute_logits(got).argmax(-1).tolist()
    assert_extend_matches_python_forward(runner, kv, reqs, ids)


def assert_extend_matches_python_forward(runner, kv, reqs, ids) -> None:
    """One mixed pass over the prefilled `reqs` (the last use of `kv`): a decode, a short extend
    and a long one over their cached prefixes, and a new 40-token prompt, so the attention backend cuts
    it into decode, short and long runs. `extend` gives the Python forward's hidden states bit for bit
    and writes the same K/V, with the extend kernel chosen as in serving and forced to each kernel; and
    so with ForwardBatch.output_rows set (the rows a prefill returns)."""
    import os

    from radixlm.runtime.layers.attention import extend_select

    decoder = runner.decode_forward
    if not decoder.takes_extend:          # GGUF weights: prefill runs the Python forward
        assert any(isinstance(layer.mlp.down_proj.packed_weight, QuantWeight) for layer in runner.model.model.layers)
        return
    gen = torch.Generator().manual_seed(11)
    vocab = runner.model_config.vocab_size
    fresh = _Req(torch.randint(3, vocab, (40,), generator=gen).tolist())
    assert kv.admit(fresh, kv.match_prefix([]))
    batch = [*reqs, fresh]
    new = [[ids[0]], [ids[1], *torch.randint(3, vocab, (2,), generator=gen).tolist()],
           [ids[2], *torch.randint(3, vocab, (extend_select.MIN_ROWS + 4,), generator=gen).tolist()], fresh.all_ids]
    prefix = [r.kv_committed_len for r in reqs] + [0]
    loc = kv.alloc_extend(batch, [len(n) for n in new])
    modes = ["auto", "simd"]
    if extend_select.brgemm_takes(runner.dtype, runner.kv_cache.dtype, runner.model_config.head_dim):
        modes.append("brgemm")
    before = os.environ.get("RADIXLM_CPU_EXTEND_KERNEL")
    try:
        with torch.inference_mode():
            for mode in modes:
                os.environ["RADIXLM_CPU_EXTEND_KERNEL"] = mode
                fb = runner.make_forward_batch(ForwardMode.EXTEND, [t for n in new for t in n],
                                               [r.req_pool_idx for r in batch], prefix,
                                               [p + len(n) for p, n in zip(prefix, new)], loc, kv.req_to_token_pool)
                runner.attn_backend.init_forward_metadata(fb)
                want = runner.model(fb.input_ids, fb.positions, fb)
                kinds = [run.kernel for run in fb.attn_metadata.runs]
                cache = list(zip(runner.kv_cache.k_buffer, runner.kv_cache.v_buffer))
                want_kv = [(k[loc].clone(), v[loc].clone()) for k, v in cache]
                for k, v in cache:                      # the decoder must write them again
                    k[loc], v[loc] = 0, 0
                runner.attn_backend.init_forward_metadata(fb)     # the decoder picks the kernels itself
                got = decoder.extend(fb)
                assert [run.kernel for run in fb.attn_metadata.runs] == kinds
                assert got.shape == want.shape and torch.equal(got, want), (mode, kinds)
                for layer, (k, v) in enumerate(cache):
                    assert torch.equal(k[loc], want_kv[layer][0]), f"K of layer {layer} ({mode})"
                    assert torch.equal(v[loc], want_kv[layer][1]), f"V of layer {layer} ({mode})"
                # Only some rows out (each request's last and one prompt row, out of order): both run the
                # last layer's o_proj and MLP on those rows alone, bit for bit alike, and give the rows of
                # the full pass (a linear over fewer rows may round differently: within bf16's step).
                ends = torch.tensor([len(n) for n in new]).cumsum(0) - 1
                fb.output_rows = torch.cat([ends, torch.tensor([int(ends[-1]) - 7, 0])])
                runner.attn_backend.init_forward_metadata(fb)
                want_rows = runner.model(fb.input_ids, fb.positions, fb)
                runner.attn_backend.init_forward_metadata(fb)
                got_rows = decoder.extend(fb)
                assert got_rows.shape == (len(fb.output_rows), want.shape[1]) and torch.equal(got_rows, want_rows)
                tol = 1e-4 if got.dtype == torch.float32 else 1.6e-2      # exact with the AVX512 gemm
                torch.testing.assert_close(got_rows, want[fb.output_rows], rtol=tol, atol=tol)
                if mode == "auto":
                    assert kinds[:2] == ["decode", "simd"] and len(kinds) == 3, kinds
    finally:
        if before is None:
            os.environ.pop("RADIXLM_CPU_EXTEND_KERNEL", None)
        else:
            os.environ["RADIXLM_CPU_EXTEND_KERNEL"] = before


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen2_moe-shared64", "qwen3_moe", "mixtral"])
def test_moe_decoder_equals_python_forward(name: str, llama_path: str, tmp_path, monkeypatch) -> None:
    """bf16 experts in the gemm layout: the sparse layers in C++ give the Python forward's bits; fp32
    experts (the torch loop) keep the Python forward. qwen2_moe-shared64: a shared expert whose
    gate_up halves are whole 64-row blocks (the fused gate_up + SiLU*mul pass)."""
    from radixlm.kernels.cpu_gemm import gemm_enabled
    from tests.unit.test_models_vs_hf import save_random_hf_model
    from tests.unit.test_moe_models import hf_config

    config = hf_config(name.split("-")[0])
    if name.endswith("shared64"):
        config.shared_expert_intermediate_size = 64
    save_random_hf_model(config, tmp_path, tokenizer_from=llama_path)
    assert isinstance(_runner(str(tmp_path), "float32").decode_forward, CompiledDecode)
    if not gemm_enabled():
        pytest.skip("MoE layers in the decoder need the AVX512-BF16 gemm kernel")
    monkeypatch.setenv("RADIXLM_CPU_LINEAR_KERNEL", "gemm")
    runner = _runner(str(tmp_path), "bfloat16")
    assert any(type(layer.mlp).__name__ == "SparseMoeBlock" for layer in runner.model.model.layers)
    assert_decoder_matches_python_forward(runner)


def test_switch_and_bad_slot(llama_path: str) -> None:
    assert isinstance(_runner(llama_path, "float32", disable_cpu_decoder=True).decode_forward, CompiledDecode)
    runner = _runner(llama_path, "float32")
    kv, reqs, ids = _prefilled_batch(runner, [6])
    seq = reqs[0].kv_committed_len
    bad = torch.tensor([runner.kv_cache.k_buffer[0].shape[0]], dtype=torch.int64)     # one past the last slot
    fb = runner.make_forward_batch(ForwardMode.DECODE, ids, [reqs[0].req_pool_idx], [seq], [seq + 1], bad,
                                   kv.req_to_token_pool)
    runner.attn_backend.init_forward_metadata(fb)
    with pytest.raises(RuntimeError, match="out of range"):
        runner.decode_forward(fb)
