"""Model code against HF transformers on the tiny models, plus the layer and config pieces.

Runs our Llama/Qwen2/Qwen3 over the paged KV cache with the torch_native backend and compares
logits with HF (fp32, max-abs-diff <= 1e-3). Also: rope and RMSNorm against HF's own functions,
TP weight slicing of the parallel linear layers, checkpoint loading (sharded, tied) and the clear
errors of ModelConfig.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from radixlm.runtime.distributed.parallel_state import destroy_tp_group, get_tp_size, init_tp_group
from radixlm.runtime.layers import linear as linear_module
from radixlm.runtime.layers import vocab_embedding as vocab_module
from radixlm.runtime.layers.attention.torch_native import TorchNativeAttnBackend
from radixlm.runtime.layers.layernorm import RMSNorm
from radixlm.runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixlm.runtime.layers.rotary import RotaryEmbedding, compute_inv_freq
from radixlm.runtime.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from radixlm.runtime.mem_cache.kv_manager import write_slots
from radixlm.runtime.mem_cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from radixlm.runtime.model_executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.models.model_config import ModelConfig, ModelLoadError
from radixlm.runtime.models.weight_loader import load_model
from radixlm.runtime.utils import free_port

TOL = 1e-3
# transformers is imported inside the tests that use it: the TP workers spawned below import this
# module and should not pay for it.


# ----------------------------------------------------------------- a minimal paged-KV runner
class PagedRunner:
    """Drives a model over a paged KV cache, one forward pass per call (the test's model runner)."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, page_size: int = 1, num_pages: int = 64,
                 use_kernels: bool = True):
        self.model, self.page_size = model, page_size
        self.pool = ReqToTokenPool(8, config.context_len, "cpu")
        self.alloc = TokenToKVPoolAllocator(num_pages, page_size)
        kv_heads = config.num_kv_heads_per_rank(get_tp_size())
        self.kv = KVCache(num_pages, page_size, config.num_layers, kv_heads, config.head_dim, config.dtype, "cpu")
        self.backend = TorchNativeAttnBackend()
        if not use_kernels:                  # the torch reference attention instead of the C++ kernels
            self.backend.kernels = None

    @torch.no_grad()
    def extend(self, rows: list[int], prefix_lens: list[int], new_ids: list[list[int]]) -> torch.Tensor:
        """Runs new tokens [prefix_len, prefix_len + len(ids)) of each request; returns their logits."""
        seq_lens = [p + len(ids) for p, ids in zip(prefix_lens, new_ids, strict=True)]
        last_locs = [int(self.pool.req_to_token[r, p - 1]) if p else 0 for r, p in zip(rows, prefix_lens, strict=True)]
        out_loc = self.alloc.alloc_extend(prefix_lens, seq_lens, last_locs)
        write_slots(self.pool.req_to_token, rows, prefix_lens, seq_lens, out_loc)
        mode = ForwardMode.DECODE if all(len(ids) == 1 for ids in new_ids) else ForwardMode.EXTEND
        fb = ForwardBatch.build(mode, [t for ids in new_ids for t in ids], rows, prefix_lens, seq_lens,
                                out_loc, self.pool, self.kv, "cpu")
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden)


def assert_prefill_extend_decode_match_hf(runner: PagedRunner, hf, vocab_size: int,
                                          tol: float = TOL) -> None:
    """Rows 0-2: one batched prefill of three prompts; row 3: prefill, extend over its cached prefix,
    then decodes. Every position's logits within `tol` of HF's."""
    prompts = random_prompts(vocab_size, [37, 5, 20], seed=1)
    logits, start = runner.extend([0, 1, 2], [0, 0, 0], prompts), 0
    for ids in prompts:
        assert (logits[start:start + len(ids)] - hf_logits(hf, ids)).abs().max().item() <= tol
        start += len(ids)
    # region table for request 3: [0, 18) prefill | [18, 26) extend over the cached prefix | [26, 30) decodes
    (ids,) = random_prompts(vocab_size, [30], seed=2)
    parts = [runner.extend([3], [0], [ids[:18]]), runner.extend([3], [18], [ids[18:26]])]
    parts += [runner.extend([3], [p], [[ids[p]]]) for p in range(26, 30)]
    assert (torch.cat(parts) - hf_logits(hf, ids)).abs().max().item() <= tol


def assert_greedy_from_shared_prefix_matches_hf(runner: PagedRunner, hf, vocab_size: int, new_tokens: int = 6) -> None:
    """Request 1 reuses request 0's KV slots for their 32 shared tokens (a radix-cache hit),
    prefills the rest, then decodes greedily: the same tokens as HF's greedy continuation."""
    shared, tail_a, tail_b = random_prompts(vocab_size, [32, 10, 14], seed=3)
    runner.extend([0], [0], [shared + tail_a])
    runner.pool.req_to_token[1, :32] = runner.pool.req_to_token[0, :32]
    b = shared + tail_b
    ours = [int(runner.extend([1], [32], [tail_b])[-1].argmax())]
    for _ in range(new_tokens - 1):
        ours.append(int(runner.extend([1], [len(b) + len(ours) - 1], [[ours[-1]]])[-1].argmax()))
    assert ours == hf_greedy_tokens(hf, b, new_tokens)


def assert_engine_radix_cache_matches_hf(path: str, hf, vocab_size: int, lengths: list[int], context_length: int,
                                         min_cached: int, new_tokens: int, tp_size: int = 1) -> None:
    """Through the scheduler (radix cache on, chunked prefill of 32, page size 16, `tp_size` ranks over
    gloo): prompts made of a shared prefix (lengths[0]) and each tail (lengths[1:]) decode HF's greedy
    tokens in two rounds, and in the second every prompt finds at least `min_cached` tokens in the cache."""
    from radixlm import Engine

    shared, *tails = random_prompts(vocab_size, lengths, seed=6)
    prompts = [shared + t for t in tails]
    expected = [hf_greedy_tokens(hf, ids, new_tokens) for ids in prompts]
    greedy = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    with Engine(model_path=path, dtype="float32", page_size=16, chunked_prefill_size=32,
                context_length=context_length, max_total_tokens=2048, tp_size=tp_size) as engine:
        for attempt in range(2):
            outs = engine.generate(input_ids=prompts, sampling_params=greedy)
            assert [o["output_ids"] for o in outs] == expected, f"round {attempt}"
        assert all(o["meta_info"]["cached_tokens"] >= min_cached for o in outs)


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_greedy_tokens(hf_model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """HF's n greedy tokens after `ids`, each from a full forward over the sequence so far (no KV cache)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(hf_logits(hf_model, ids)[-1].argmax()))
    return ids[-n:]


# ----------------------------------------------------------------- tiny random HF checkpoints
def save_random_hf_model(config, folder: Path, tokenizer_from: str | None = None,
                         perturb: Callable[[str, torch.nn.Parameter], None] | None = None) -> torch.nn.Module:
    """A random fp32 HF model built from `config` (torch seed 0), `perturb(name, param)` applied to
    each parameter under no_grad, saved in `folder` with the tokenizer files of the model folder
    `tokenizer_from`; returns the HF model in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if perturb is not None:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                perturb(name, p)
    hf.save_pretrained(str(folder))
    if tokenizer_from is not None:
        for f in Path(tokenizer_from).iterdir():
            if "token" in f.name or f.name.endswith(".jinja"):
                shutil.copy(f, folder / f.name)
    return hf.eval()


def load_ours(path: str | Path, **config_kwargs) -> tuple[ModelConfig, torch.nn.Module]:
    """Our config (ModelConfig.from_path with `config_kwargs`) and CPU model for the checkpoint at `path`."""
    config = ModelConfig.from_path(str(path), **config_kwargs)
    return config, load_model(config, "cpu", show_progress=False)


@pytest.fixture(scope="module")
def loaded(tiny_model_path: str):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    config = ModelConfig.from_path(tiny_model_path)
    model = load_model(config, "cpu", show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return config, model, hf


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


# ----------------------------------------------------------------- model vs HF
@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_prefill_matches_hf(loaded, page_size: int) -> None:
    config, model, hf = loaded
    prompts = random_prompts(config.vocab_size, [37, 5, 20], seed=1)
    runner = PagedRunner(model, config, page_size)
    logits = runner.extend([0, 1, 2], [0, 0, 0], prompts)
    start = 0
    for ids in prompts:
        ours = logits[start: start + len(ids)]
        start += len(ids)
        assert ours.dtype == torch.float32 and ours.shape == (len(ids), config.vocab_size)
        assert (ours - hf_logits(hf, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_extend_and_decode_match_hf(loaded, page_size: int) -> None:
    config, model, hf = loaded
    (ids,) = random_prompts(config.vocab_size, [30], seed=2)
    ref = hf_logits(hf, ids)
    runner = PagedRunner(model, config, page_size)
    # region table: [0, 18) first pass | [18, 26) extend over the cached prefix | [26, 30) decodes
    first = runner.extend([3], [0], [ids[:18]])
    second = runner.extend([3], [18], [ids[18:26]])
    decodes = [runner.extend([3], [p], [[ids[p]]]) for p in range(26, 30)]
    ours = torch.cat([first, second, *decodes])
    assert (ours - ref).abs().max().item() <= TOL


def test_greedy_argmax_agrees_with_hf(loaded) -> None:
    config, model, hf = loaded
    (ids,) = random_prompts(config.vocab_size, [12], seed=3)
    ours = PagedRunner(model, config).extend([0], [0], [ids])
    assert torch.equal(ours.argmax(-1), hf_logits(hf, ids).argmax(-1))


# ----------------------------------------------------------------- layers vs HF functions
def test_llama3_inv_freq_matches_hf() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    hf_config = LlamaConfig(hidden_size=128, num_attention_heads=4, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = compute_inv_freq(32, 10000.0, params)
    default = compute_inv_freq(32, 10000.0, None)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    # the three wavelength bands are all present: kept, divided by factor, smoothed
    ratio = default / ours
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def test_rotary_matches_hf_apply() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    n, heads, head_dim = 7, 3, 16
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    positions = torch.tensor([0, 5, 9, 1, 63, 2, 2])
    q, k = torch.randn(n, heads * head_dim), torch.randn(n, heads * head_dim)
    inv = compute_inv_freq(head_dim, 10000.0, None)
    emb = torch.cat([positions[:, None] * inv] * 2, dim=-1)
    q_hf, k_hf = apply_rotary_pos_emb(q.view(1, n, heads, head_dim), k.view(1, n, heads, head_dim),
                                      emb.cos()[None], emb.sin()[None], unsqueeze_dim=2)
    q_ours, k_ours = rope(positions, q, k)
    torch.testing.assert_close(q_ours, q_hf.reshape(n, -1))
    torch.testing.assert_close(k_ours, k_hf.reshape(n, -1))


def test_rmsnorm_matches_hf() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x, w = torch.randn(5, 32), torch.randn(32)
    ours, theirs = RMSNorm(32, 1e-5), LlamaRMSNorm(32, eps=1e-5)
    ours.weight.data.copy_(w)
    theirs.weight.data.copy_(w)
    torch.testing.assert_close(ours(x), theirs(x))


# ----------------------------------------------------------------- TP weight slicing (no process group)
def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    """Layers built now act as TP rank `rank` of `size`; collectives stay no-ops (no group)."""
    for module in (linear_module, vocab_module):
        monkeypatch.setattr(module, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(module, "get_tp_size", lambda: size)


def _load(layer: torch.nn.Module, name: str, full: torch.Tensor, shard_id: object = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, full, shard_id)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_and_row_shards_recompose(monkeypatch: pytest.MonkeyPatch, tp_size: int) -> None:
    torch.manual_seed(0)
    x, w_col, b_col, w_row = torch.randn(3, 8), torch.randn(12, 8), torch.randn(12), torch.randn(6, 12)
    col_parts, row_parts = [], []
    for rank in range(tp_size):
        _as_rank(monkeypatch, rank, tp_size)
        col, row = ColumnParallelLinear(8, 12, bias=True), RowParallelLinear(12, 6)
        _load(col, "weight", w_col)
        _load(col, "bias", b_col)
        _load(row, "weight", w_row)
        col_parts.append(col(x))
        row_parts.append(row(col_parts[-1]))  # the partial sum this rank would all-reduce
    full = x @ w_col.T + b_col
    torch.testing.assert_close(torch.cat(col_parts, dim=-1), full)
    torch.testing.assert_close(sum(row_parts), full @ w_row.T)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_and_gate_up_shards(monkeypatch: pytest.MonkeyPatch, tp_size: int) -> None:
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads = 8, 4, 4, 2
    x = torch.randn(3, hidden)
    wq, wk, wv = torch.randn(heads * head_dim, hidden), torch.randn(kv_heads * head_dim, hidden), torch.randn(
        kv_heads * head_dim, hidden)
    wg, wu = torch.randn(10 * tp_size, hidden), torch.randn(10 * tp_size, hidden)
    for rank in range(tp_size):
        _as_rank(monkeypatch, rank, tp_size)
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
        for shard_id, w in (("q", wq), ("k", wk), ("v", wv)):
            _load(qkv, "weight", w, shard_id)
        q, k, v = qkv.split_qkv(qkv(x))
        kv_head = rank * kv_heads // tp_size  # sharded (tp <= kv) or replicated (tp > kv)
        n_kv = max(1, kv_heads // tp_size)
        q_rows = slice(rank * heads // tp_size * head_dim, (rank + 1) * heads // tp_size * head_dim)
        kv_rows = slice(kv_head * head_dim, (kv_head + n_kv) * head_dim)
        torch.testing.assert_close(q, x @ wq[q_rows].T)
        torch.testing.assert_close(k, x @ wk[kv_rows].T)
        torch.testing.assert_close(v, x @ wv[kv_rows].T)
        gate_up = MergedColumnParallelLinear(hidden, [10 * tp_size, 10 * tp_size])
        _load(gate_up, "weight", wg, 0)
        _load(gate_up, "weight", wu, 1)
        rows = slice(rank * 10, (rank + 1) * 10)
        torch.testing.assert_close(gate_up(x), torch.cat([x @ wg[rows].T, x @ wu[rows].T], dim=-1))


@pytest.mark.parametrize("tp_size", [1, 3, 4])
def test_vocab_shards_with_padding(monkeypatch: pytest.MonkeyPatch, tp_size: int) -> None:
    torch.manual_seed(0)
    vocab, hidden = 10, 4                        # 10 rows do not split evenly over 3 or 4 ranks
    table, ids, h = torch.randn(vocab, hidden), torch.tensor([0, 9, 4, 3, 9]), torch.randn(2, hidden)
    embed_parts, logit_parts = [], []
    for rank in range(tp_size):
        _as_rank(monkeypatch, rank, tp_size)
        embed = VocabParallelEmbedding(vocab, hidden)
        _load(embed, "weight", table)
        embed_parts.append(embed(ids))                       # each rank's share of the all-reduce
        logit_parts.append(ParallelLMHead(vocab, hidden, tied_to=embed)(h))   # its share of the gather
    torch.testing.assert_close(sum(embed_parts), table[ids])
    torch.testing.assert_close(torch.cat(logit_parts, dim=-1)[:, :vocab], h @ table.T)


def test_shard_shape_mismatch_is_refused() -> None:
    col = ColumnParallelLinear(8, 12)
    with pytest.raises(ValueError, match="shape mismatch"):
        col.weight.weight_loader(col.weight, torch.randn(12, 1))


# ----------------------------------------------------------------- TP = 2 over gloo
def _tp_worker(rank: int, size: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    init_tp_group(rank, size, "gloo", f"tcp://127.0.0.1:{port}")
    try:
        result = {}
        for name, path in paths.items():
            config = ModelConfig.from_path(path)
            model = load_model(config, "cpu", show_progress=False)
            prompts = random_prompts(config.vocab_size, [9, 4], seed=5)
            result[name] = PagedRunner(model, config).extend([0, 1], [0, 0], prompts)
            result[name + ".params"] = sum(p.numel() for p in model.parameters())
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_tp_group()


def test_tp2_gloo_matches_tp1(tiny_models: dict[str, str], tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_tp_worker, args=(2, free_port(), tiny_models, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, path in tiny_models.items():
        config = ModelConfig.from_path(path)
        model = load_model(config, "cpu", show_progress=False)
        single = PagedRunner(model, config).extend([0, 1], [0, 0], random_prompts(config.vocab_size, [9, 4], 5))
        full_params = sum(p.numel() for p in model.parameters())
        for result in ranks:
            assert (result[name] - single).abs().max().item() <= 1e-4, name
            assert result[name + ".params"] < 0.75 * full_params, name   # about half per rank


# ----------------------------------------------------------------- checkpoint loading
def test_sharded_checkpoint_loads_like_single_file(llama_path: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    single = load_model(ModelConfig.from_path(llama_path), show_progress=False)
    split = load_model(ModelConfig.from_path(str(sharded)), show_progress=False)
    for (name, a), (_, b) in zip(single.named_parameters(), split.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tied_embedding_is_the_lm_head(qwen2_path: str) -> None:
    model = load_model(ModelConfig.from_path(qwen2_path), show_progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_missing_weight_is_a_clear_error(qwen3_path: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(qwen3_path, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.1.self_attn.qkv_proj.weight"):
        load_model(ModelConfig.from_path(str(folder)), show_progress=False)


def test_bf16_dtype_builds_bf16_params(llama_path: str) -> None:
    model = load_model(ModelConfig.from_path(llama_path, dtype="bfloat16"), show_progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_cache.dtype == torch.float32


# ----------------------------------------------------------------- ModelConfig
def _copy_with_config(src: str, dst: Path, **changes: object) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_config_fields(tiny_models: dict[str, str]) -> None:
    llama = ModelConfig.from_path(tiny_models["llama"])
    assert (llama.architecture, llama.num_heads, llama.num_kv_heads, llama.head_dim) == ("LlamaForCausalLM", 4, 2, 16)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.dtype == torch.float32
    assert llama.eos_token_ids == [2] and llama.context_len == 2048
    qwen3 = ModelConfig.from_path(tiny_models["qwen3"], context_length=512)
    assert qwen3.head_dim == 32 and qwen3.context_len == 512 and qwen3.rope_scaling is None
    assert qwen3.num_kv_heads_per_rank(2) == 1
    assert ModelConfig.from_path(tiny_models["qwen2"]).tie_word_embeddings


def test_config_accepts_old_format(llama_path: str, tmp_path: Path) -> None:
    path = _copy_with_config(
        llama_path, tmp_path / "old", rope_parameters=None, dtype=None, torch_dtype="bfloat16", rope_theta=500000.0,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256})
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    cfg = ModelConfig.from_path(path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.dtype == torch.bfloat16 and cfg.eos_token_ids == [2, 0]
    assert ModelConfig.from_path(path, dtype="float32").dtype == torch.float32


def test_missing_path_error() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig.from_path("/nonexistent/radixlm/model")


def test_hub_id_offline_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="Hugging Face Hub"):
        ModelConfig.from_path("radixlm-test/no-such-model")


def test_folder_without_config_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        ModelConfig.from_path(str(tmp_path))


def test_unsupported_architecture_error(llama_path: str, tmp_path: Path) -> None:
    path = _copy_with_config(llama_path, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        ModelConfig.from_path(path)


def test_unsupported_rope_error(llama_path: str, tmp_path: Path) -> None:
    path = _copy_with_config(llama_path, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope_type 'yarn'"):
        ModelConfig.from_path(path)


def test_context_too_long_error(llama_path: str) -> None:
    with pytest.raises(ModelLoadError, match="larger than the model's max_position_embeddings"):
        ModelConfig.from_path(llama_path, context_length=4096)


def test_tp_size_not_dividing_heads_error(llama_path: str) -> None:
    with pytest.raises(ModelLoadError, match="not divisible by tp size"):
        ModelConfig.from_path(llama_path).check_tp_size(3)
