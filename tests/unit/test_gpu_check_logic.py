"""The GPU check's own driver code, run on CPU: the step-by-step greedy loop of scripts/gpu_check.py
(used by its greedy, CUDA-graph and decode-speed phases) must drive the runtime as the scheduler
does. Its first GPU run failed every greedy check at the first decode because the loop set a field
the KV manager no longer reads; on CPU with torch_native it must equal HF's greedy tokens."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module                # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    module.DEVICE = "cpu"
    return module


@pytest.mark.parametrize("page_size", [1, 16])
def test_runner_greedy_equals_hf(gpu_check, llama_path: str, page_size: int) -> None:
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    hf = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    theirs = gpu_check.hf_generate(hf, prompts, 10)
    ours = gpu_check.runner_greedy(llama_path, "torch_native", page_size, "float32", prompts, 10)
    assert [o[: len(t)] for o, t in zip(ours, theirs, strict=True)] == theirs
