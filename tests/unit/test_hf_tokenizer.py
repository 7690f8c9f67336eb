"""get_tokenizer gives AutoTokenizer's tokenizer: for each model type it builds TokenizersBackend
directly (runtime/hf_tokenizer.py), AutoTokenizer picks that same class and encodes, decodes and
templates alike; where AutoTokenizer swaps in another class (Qwen2) or the folder has custom code,
get_tokenizer goes through AutoTokenizer. The direct path imports no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixlm.runtime.hf_tokenizer import DIRECT_MODEL_TYPES, direct_class_applies, get_tokenizer

TEXT = "Hello <|im_start|>user\n wörld  12345 ça va? 日本語<|im_end|>"


def tokenizer_folder(tmp_path: Path, src: str, model_type: str, **extra) -> str:
    folder = tmp_path / model_type
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **extra}))
    return str(folder)


@pytest.mark.parametrize("model_type", sorted(DIRECT_MODEL_TYPES) + ["qwen2"])
def test_same_tokenizer_as_auto_tokenizer(tmp_path: Path, llama_path: str, model_type: str) -> None:
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path, llama_path, model_type)
    want, got = AutoTokenizer.from_pretrained(folder), get_tokenizer(folder)
    assert direct_class_applies(folder) == (model_type != "qwen2")
    assert type(got) is type(want)
    ids = want(TEXT)["input_ids"]
    assert got(TEXT)["input_ids"] == ids and got.decode(ids) == want.decode(ids)
    assert got.all_special_tokens == want.all_special_tokens and got.eos_token_id == want.eos_token_id
    messages = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(messages, tokenize=False) == want.apply_chat_template(messages, tokenize=False)


def test_custom_code_and_unknown_types_go_through_auto_tokenizer(tmp_path: Path, llama_path: str) -> None:
    assert not direct_class_applies(tokenizer_folder(tmp_path, llama_path, "llama", auto_map={"AutoTokenizer": "x.Y"}))
    assert not direct_class_applies(tokenizer_folder(tmp_path, llama_path, "bert"))
    assert not direct_class_applies(str(tmp_path / "missing"))
    assert not direct_class_applies("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_direct_path_imports_no_torch(llama_path: str) -> None:
    code = ("import sys; from radixlm.runtime.hf_tokenizer import get_tokenizer; "
            f"t = get_tokenizer({llama_path!r}); print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["TokenizersBackend", "False"], out.stderr
