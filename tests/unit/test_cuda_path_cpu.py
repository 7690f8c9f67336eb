"""CPU-side checks of the CUDA path (issue 28): the dtype `auto` resolves to on CUDA, the GPU index
of each dp x tp scheduler, no CPU C++ extension build when no tensor is on the CPU, and no
device-table read in `alloc_extend` when the host copy of the last slot is current."""

from __future__ import annotations

import logging

import pytest
import torch
from sched_fakes import make_kv, make_req

from radixlm.kernels import cpu_ops
from radixlm.runtime.distributed.parallel_state import gpu_index
from radixlm.runtime.layers import packed_linear
from radixlm.runtime.layers.activation import SiluAndMul
from radixlm.runtime.layers.layernorm import RMSNorm
from radixlm.runtime.models.model_config import ModelConfig, resolve_dtype
from radixlm.runtime.models.weight_loader import build_model


@pytest.mark.parametrize("hf,device,want", [
    ({"dtype": "float32"}, "cuda", torch.bfloat16),        # fp32 checkpoint: bf16 on GPU
    ({}, "cuda", torch.bfloat16),                         # no dtype named: fp32 -> bf16 on GPU
    ({"torch_dtype": "float16"}, "cuda", torch.float16),  # a half-precision checkpoint keeps its dtype
    ({"dtype": "bfloat16"}, "cuda", torch.bfloat16),
    ({"dtype": "float32"}, "cpu", torch.float32),         # CPU keeps the checkpoint's dtype
    ({}, "cpu", torch.float32),
])
def test_auto_dtype_on_cuda(hf: dict, device: str, want: torch.dtype) -> None:
    assert resolve_dtype("auto", hf, device) == want


def test_auto_dtype_logs_the_bf16_choice_and_explicit_dtype_wins(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="radixlm.runtime.models.model_config"):
        assert resolve_dtype("auto", {"dtype": "float32"}, "cuda") == torch.bfloat16
    assert any("bfloat16 on CUDA" in r.message for r in caplog.records)
    assert resolve_dtype("float32", {"dtype": "float32"}, "cuda") == torch.float32


def test_model_config_auto_dtype_follows_the_device(llama_path: str) -> None:
    assert ModelConfig.from_path(llama_path).dtype == torch.float32          # tiny models are fp32
    assert ModelConfig.from_path(llama_path, device="cuda").dtype == torch.bfloat16


@pytest.mark.parametrize("dp,tp,tp_size,count,want", [
    (0, 0, 1, 1, 0), (0, 1, 2, 2, 1), (1, 0, 2, 4, 2), (1, 1, 2, 4, 3), (3, 0, 1, 8, 3), (2, 1, 4, 16, 9),
])
def test_gpu_index_gives_every_dp_tp_rank_its_own_gpu(dp: int, tp: int, tp_size: int, count: int,
                                                     want: int) -> None:
    assert gpu_index(dp, tp, tp_size, count) == want


def test_gpu_index_all_distinct_and_refuses_too_few_gpus() -> None:
    seen = {gpu_index(d, t, 4, 8) for d in range(2) for t in range(4)}
    assert seen == set(range(8))
    with pytest.raises(ValueError, match="needs GPU 2, but this machine has 2"):
        gpu_index(1, 0, 2, 2)
    assert gpu_index(0, 3, 4, 2, nnodes=2) == 1              # TP over 2 nodes: the second node's rank 1


@pytest.fixture
def no_cpu_builds(monkeypatch):
    """Every CPU C++ extension loader fails the test if called."""
    def fail(*_args, **_kwargs):
        raise AssertionError("a CPU C++ extension was loaded/built for tensors that are not on the CPU")

    monkeypatch.setattr(cpu_ops, "load_cpu_ops", fail)
    monkeypatch.setattr(cpu_ops, "_loaded", {})
    monkeypatch.setattr(packed_linear, "load_cpu_gemm", fail)


def test_no_cpu_extension_build_for_tensors_off_the_cpu(no_cpu_builds, llama_path: str) -> None:
    config = ModelConfig.from_path(llama_path, dtype="bfloat16")
    model = build_model(config, "meta")                       # what a CUDA model is, to the CPU code
    assert packed_linear.pack_linear_weights(model) == 0      # nothing to pack, no gemm build
    with torch.device("meta"):
        norm = RMSNorm(64)
        x = torch.empty(3, 64, dtype=torch.bfloat16)
        gate_up = torch.empty(3, 128, dtype=torch.bfloat16)
    assert norm(x).device.type == "meta"
    assert norm(x, x.clone())[0].device.type == "meta"
    assert SiluAndMul()(gate_up).shape == (3, 64)
    assert not cpu_ops.fits(x)


def test_alloc_extend_uses_the_host_copy_of_the_last_slot() -> None:
    """Page size 4: the decode token continues the page of token prefix_len-1. Its slot must come
    from the host copy, not the table: a wrong value planted in the table must not be read."""
    kv = make_kv(64, 4)
    req = make_req("a", list(range(3, 13)))
    match = kv.match_prefix([])
    kv.lock(match.last_node)
    assert kv.admit(req, match)
    first = kv.alloc_extend([req], [6])
    req.kv_committed_len = 6
    table = kv.req_to_token_pool.req_to_token
    table[req.req_pool_idx, 5] = 40                          # planted: a table read would continue slot 40
    nxt = kv.alloc_extend([req], [1])
    assert nxt.tolist() == [int(first[5]) + 1]
    req.kv_committed_len = 7
    table[req.req_pool_idx, 5] = int(first[5])
    req.kv_committed_len = 6                                        # rolled back: the host copy (end 7) is stale,
    table[req.req_pool_idx, 6] = 0                            # so the table is read, and its value is used
    again = kv.alloc_extend([req], [1])
    assert again.tolist() == [int(first[5]) + 1]
