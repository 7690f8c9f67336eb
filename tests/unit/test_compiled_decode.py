"""--enable-torch-compile: the compiled decode step gives the same greedy tokens as HF (and as eager).

One compile of the tiny llama (a minute or more on 2 busy cores): every request has the same
output length, so all decode passes share one batch-size class.
"""

from __future__ import annotations

from helpers import SchedulerHarness, hf_greedy, random_prompts


def test_compiled_decode_greedy_matches_hf(llama_path: str) -> None:
    prompts = random_prompts(4, 1900, seed=3, lo=6, hi=30)
    refs = [hf_greedy(llama_path, p, 8) for p in prompts]
    h = SchedulerHarness(llama_path, enable_torch_compile=True)
    assert h.scheduler.runner.decode_forward.enabled
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, max_new_tokens=8, temperature=0, ignore_eos=True)
    res = h.run()
    assert [res[f"r{i}"]["output_ids"] for i in range(4)] == refs
    assert h.scheduler.runner.decode_forward._seen == {False}      # compiled once, for batch > 1
