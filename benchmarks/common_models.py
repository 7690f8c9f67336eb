"""The Qwen2-shaped random models the throughput benchmarks run on (built once, then cached).

The tokenizer is radixlm.testing.models' byte-level BPE, padded to the model's vocabulary size.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

from radixlm.testing.models import stdlib_texts, train_bpe_tokenizer

# The real Qwen2-0.5B shape, and a tiny one for tests and smoke runs.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=2048),
}
def add_model_args(p: Any) -> None:
    """Adds --model-path, and --model-size / --vocab-size for the random model that
    `make_qwen2_model` builds when no --model-path is given, to the argparse parser `p`."""
    p.add_argument("--model-path", help="model folder (default: a random Qwen2-shaped bf16 model, see --model-size)")
    p.add_argument("--model-size", default="0.5b", choices=sorted(MODEL_SHAPES),
                   help="shape of the random model made when no --model-path is given "
                        "(default: %(default)s = hidden 896, 24 layers, 14/2 heads)")
    p.add_argument("--vocab-size", type=int, help="vocabulary of the random model (default: the shape's, 151936)")


def default_model_cache() -> Path:
    return Path(os.environ.get("RADIXLM_BENCH_MODELS", Path(tempfile.gettempdir()) / "radixlm-bench-models"))


def build_tokenizer(vocab_size: int, out_dir: Path, bpe_size: int = 4096) -> None:
    """A byte-level BPE (trained on stdlib source, ChatML specials at ids 0-2) whose vocabulary is
    padded with `<extra_N>` tokens to exactly `vocab_size`, so every id the model samples decodes
    and real text tokenizes like text (distinct words get distinct ids)."""
    texts = stdlib_texts(1_500_000 if vocab_size > bpe_size else 300_000)
    train_bpe_tokenizer(texts, min(vocab_size, bpe_size), pad_vocab_to=vocab_size).save_pretrained(str(out_dir))


def make_qwen2_model(size: str = "0.5b", vocab_size: int | None = None, seed: int = 0,
                     cache_dir: str | Path | None = None) -> str:
    """Builds (once, then reuses) a random Qwen2-shaped bf16 model folder; returns its path.

    `size` is a key of MODEL_SHAPES; `vocab_size` overrides the shape's vocabulary.
    initializer_range 0.1 keeps greedy argmax away from ties (see MACHINE_FACTS.md).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(MODEL_SHAPES[size])
    if vocab_size:
        shape["vocab_size"] = vocab_size
    root = Path(cache_dir) if cache_dir else default_model_cache()
    folder = root / f"qwen2-{size}-v{shape['vocab_size']}-s{seed}-bpe"
    if (folder / "DONE").exists():
        return str(folder)
    building = Path(f"{folder}.building-{os.getpid()}")
    building.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(**shape, initializer_range=0.1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(building))
    build_tokenizer(shape["vocab_size"], building)
    del model
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    building.rename(folder)
    (folder / "DONE").write_text("ok\n")
    return str(folder)


def count_params(model_path: str) -> int:
    """Parameters stored in a model folder's safetensors files (tied weights counted once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                total += math.prod(st.get_slice(key).get_shape())
    return total
