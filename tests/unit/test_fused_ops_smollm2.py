"""SmolLM2-135M-Instruct in bf16: the fused CPU ops (kernels/cpu_ops) give exactly the eager torch
path's greedy tokens, on all the real chat prompts in one mixed batch, with the radix cache and
chunked prefill on. The kernels round where the torch code (and HF) rounds and sum in torch's order,
so any divergence here is a numerics bug. The same run without the ops is the reference."""

from __future__ import annotations

import pytest

from helpers import SchedulerHarness
from radixlm.kernels import cpu_ops
from tests.real_model import CHAT_PROMPTS, chat_ids, smollm2_gguf

MAX_NEW = 24


def greedy_bf16(ids: list[list[int]]) -> list[list[int]]:
    h = SchedulerHarness(smollm2_gguf(), dtype="bfloat16", context_length=2048, max_total_tokens=8192,
                         chunked_prefill_size=64, page_size=16)
    for i, x in enumerate(ids):
        h.submit(f"r{i}", x, max_new_tokens=MAX_NEW, temperature=0)
    res = h.run()
    return [res[f"r{i}"]["output_ids"] for i in range(len(ids))]


@pytest.mark.skipif(cpu_ops.load_cpu_ops() is None, reason="fused CPU ops unavailable")
def test_fused_ops_greedy_equals_eager_torch_in_bf16(monkeypatch) -> None:
    from transformers import AutoTokenizer

    from radixlm.runtime.models.resolve import hf_pretrained_args

    folder, kwargs = hf_pretrained_args(smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=kwargs["gguf_file"])
    ids = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS]
    assert cpu_ops.enabled()
    fused = greedy_bf16(ids)
    monkeypatch.setitem(cpu_ops._loaded, "mod", None)          # the layers take their torch code
    assert not cpu_ops.enabled()
    eager = greedy_bf16(ids)
    for i, (a, b) in enumerate(zip(fused, eager)):
        assert a == b, f"prompt {i} ({CHAT_PROMPTS[i]!r})"
    assert all(len(a) > 0 for a in fused)
