"""Device-dependent defaults that ServerArgs.resolved() fills in: the prefill budgets."""

from __future__ import annotations

from radixlm.runtime.server_args import PREFILL_DEFAULTS, ServerArgs


def test_cpu_prefill_budget_defaults_and_explicit_values_win(llama_path):
    args = ServerArgs.from_kwargs(model_path=llama_path, device="cpu").resolved()
    budgets = (args.chunked_prefill_size, args.max_prefill_tokens, args.prefill_step_tokens)
    assert budgets == PREFILL_DEFAULTS["cpu"] == (2048, 2048, -1)   # -1: auto
    args = ServerArgs.from_kwargs(model_path=llama_path, device="cpu", chunked_prefill_size=-1,
                                  max_prefill_tokens=5000, prefill_step_tokens=0).resolved()
    assert (args.chunked_prefill_size, args.max_prefill_tokens, args.prefill_step_tokens) == (-1, 5000, 0)
    assert PREFILL_DEFAULTS["cuda"] == (8192, 16384, 0)   # SGLang's budgets on GPUs, steps filled
