"""SmolLM2-135M-Instruct in bf16: the fused CPU ops (kernels/cpu_ops) give exactly the eager torch
path's greedy tokens, on all the real chat prompts in one mixed batch, with the radix cache and
chunked prefill on; and so does the compiled decode step (--enable-torch-compile), which calls the
same ops as custom ops. The kernels round where the torch code (and HF) rounds and sum in torch's
order, so any divergence here is a numerics bug. The run without the ops is the reference."""

from __future__ import annotations

import pytest
from helpers import SchedulerHarness

from radixlm.kernels import cpu_ops
from tests.real_model import CHAT_PROMPTS, chat_ids, hf_tokenizer, smollm2_gguf

MAX_NEW = 24
COMPILED_LAYERS = 6

pytestmark = pytest.mark.skipif(cpu_ops.load_cpu_ops() is None, reason="fused CPU ops unavailable")


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    return [chat_ids(hf_tokenizer(), p) for p in CHAT_PROMPTS]


def torch_greedy(prompt_ids: list[list[int]], **kwargs) -> list[list[int]]:
    """Greedy tokens with the layers' torch code (the fused ops switched off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(cpu_ops._loaded, "mod", None)
        assert not cpu_ops.enabled()
        return greedy_bf16(prompt_ids, **kwargs)


@pytest.fixture(scope="module")
def torch_tokens(prompt_ids) -> list[list[int]]:
    return torch_greedy(prompt_ids)


def greedy_bf16(ids: list[list[int]], ignore_eos: bool = False, **kwargs) -> list[list[int]]:
    return greedy_run(ids, ignore_eos, **kwargs)[0]


def greedy_run(ids: list[list[int]], ignore_eos: bool, **kwargs) -> tuple[list[list[int]], SchedulerHarness]:
    h = SchedulerHarness(smollm2_gguf(), dtype="bfloat16", context_length=2048, max_total_tokens=8192,
                         chunked_prefill_size=64, page_size=16, **kwargs)
    for i, x in enumerate(ids):
        h.submit(f"r{i}", x, max_new_tokens=MAX_NEW, temperature=0, ignore_eos=ignore_eos)
    res = h.run()
    return [res[f"r{i}"]["output_ids"] for i in range(len(ids))], h


def assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    assert all(len(a) > 0 for a in want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"prompt {i} ({CHAT_PROMPTS[i]!r})"


def test_fused_ops_greedy_equals_eager_torch_in_bf16(prompt_ids, torch_tokens) -> None:
    assert cpu_ops.enabled()
    assert_same(greedy_bf16(prompt_ids), torch_tokens)


def test_compiled_decode_with_fused_ops_equals_eager_torch_in_bf16(prompt_ids) -> None:
    """SmolLM2's first COMPILED_LAYERS layers (--json-model-override-args): the compiled graph is
    the same code per layer, and compiling all 30 takes minutes on 2 cores (about 9 s a layer).
    Every request runs to MAX_NEW tokens, so only the batch > 1 graph compiles
    (test_compiled_decode.py compiles batch 1 too, on the tiny llama). The compiled path keeps the
    plain F.linear weights (inductor packs its own), so the eager reference does too: the packed
    gemm layout (kernels/cpu_gemm) sums in its own order."""
    cut = {"json_model_override_args": f'{{"num_hidden_layers": {COMPILED_LAYERS}}}'}
    want = torch_greedy(prompt_ids, ignore_eos=True, disable_packed_weights=True, **cut)
    assert cpu_ops.enabled()
    got, h = greedy_run(prompt_ids, ignore_eos=True, enable_torch_compile=True, **cut)
    assert len(h.scheduler.runner.model.model.layers) == COMPILED_LAYERS
    assert h.scheduler.runner.decode_forward._seen == {False}
    assert_same(got, want)
