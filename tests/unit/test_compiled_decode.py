"""--enable-torch-compile: the compiled decode step gives the same greedy tokens as HF (and as eager).

Both batch-size classes compile on the tiny llama (torch specializes batch 1): the last request
asks for more tokens than the others, so it decodes alone at the end. The real-model test
(test_fused_ops_smollm2.py) compiles batch > 1 only: each of SmolLM2's 30-layer compiles takes
minutes on 2 cores.
"""

from __future__ import annotations

from helpers import SchedulerHarness, hf_greedy, random_prompts


def test_compiled_decode_greedy_matches_hf(llama_path: str) -> None:
    prompts = random_prompts(4, 1900, seed=3, lo=6, hi=30)
    lengths = [8, 8, 8, 12]
    refs = [hf_greedy(llama_path, p, n) for p, n in zip(prompts, lengths)]
    h = SchedulerHarness(llama_path, enable_torch_compile=True)
    assert h.scheduler.runner.decode_forward.enabled
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        h.submit(f"r{i}", p, max_new_tokens=n, temperature=0, ignore_eos=True)
    res = h.run()
    assert [res[f"r{i}"]["output_ids"] for i in range(4)] == refs
    assert h.scheduler.runner.decode_forward._seen == {False, True}   # batch > 1, then batch 1 (r3 alone)
