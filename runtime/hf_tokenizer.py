"""get_tokenizer(path): the tokenizer AutoTokenizer.from_pretrained(path) gives, built faster where
that is safe.

AutoTokenizer first builds the model's config class to pick the tokenizer class, which imports
torch and much of transformers: about 3 s of CPU in each of the server's three processes at every
start on a 2-core machine. A local folder whose tokenizer_config.json names `TokenizersBackend`
(what transformers 5 writes, and what radixlm's GGUF folders hold) with no custom code gets that
class directly, for the model types where AutoTokenizer keeps it (tests/unit/test_hf_tokenizer.py
checks each against AutoTokenizer: Qwen2, for one, gets its own Qwen2Tokenizer). Anything else
goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# model types whose config.json leaves a declared TokenizersBackend in place under AutoTokenizer
DIRECT_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
                                "gemma3", "gemma3_text", "phi3", "olmo2"})
MISTRAL_FORMAT_FILES = ("tekken.json", "params.json")     # AutoTokenizer may pick MistralCommonBackend


def get_tokenizer(path: str) -> Any:
    """The tokenizer for a local folder or hub id (AutoTokenizer's choice of class)."""
    if direct_class_applies(path):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def direct_class_applies(path: str) -> bool:
    """Whether `path` is a local folder whose declared TokenizersBackend AutoTokenizer would keep."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file() or any((folder / f).exists() for f in MISTRAL_FORMAT_FILES):
        return False
    tokenizer_config, config = _read_json(folder / "tokenizer_config.json"), _read_json(folder / "config.json")
    return (tokenizer_config.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in tokenizer_config
            and "auto_map" not in config and config.get("model_type") in DIRECT_MODEL_TYPES)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
