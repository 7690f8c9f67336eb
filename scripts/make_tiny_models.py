"""Builds the tiny, fully offline test models: a locally trained tokenizer and three random models.

Output layout (one HF model folder per architecture, each with its own copy of the tokenizer):

    OUT/tokenizer/       byte-level BPE tokenizer (ChatML template, `<|im_end|>` as eos)
    OUT/llama/           LlamaForCausalLM, GQA 4/2 heads, llama3 rope scaling
    OUT/qwen2/           Qwen2ForCausalLM, qkv bias, tied embeddings
    OUT/qwen3/           Qwen3ForCausalLM, q/k RMSNorm, explicit head_dim, one kv head (MQA)

Weights are random (seeded, initializer_range 0.1 so greedy argmax is stable), saved in fp32 as
safetensors. Usage: `python scripts/make_tiny_models.py --out DIR`.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from radixlm.testing.models import EOS_TOKEN, PAD_TOKEN, stdlib_texts, train_bpe_tokenizer

VOCAB_SIZE = 2000
TRAIN_BYTES = 3_000_000
COMMON_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    initializer_range=0.1,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)


def build_tokenizer(out_dir: Path):
    """Trains the byte-level BPE on stdlib source and saves it as an HF fast tokenizer."""
    hf_tok = train_bpe_tokenizer(stdlib_texts(TRAIN_BYTES), VOCAB_SIZE)
    hf_tok.save_pretrained(str(out_dir))
    return hf_tok


def model_specs(vocab_size: int, eos_id: int, pad_id: int) -> dict[str, object]:
    """The three transformers configs, keyed by folder name."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    ids = dict(vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=pad_id, pad_token_id=pad_id)
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return {
        "llama": LlamaConfig(**COMMON_CONFIG, **ids, num_hidden_layers=2, num_key_value_heads=2,
                             rope_parameters=llama3_rope, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON_CONFIG, **ids, num_hidden_layers=2, num_key_value_heads=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                             tie_word_embeddings=True),
        "qwen3": Qwen3Config(**COMMON_CONFIG, **ids, num_hidden_layers=3, num_key_value_heads=1,
                             head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                             tie_word_embeddings=False),
    }


def build_model(name: str, config, seed: int, out_dir: Path, tokenizer_dir: Path) -> None:
    """Random-inits one model (seeded), saves it as fp32 safetensors, copies the tokenizer in."""
    from transformers import AutoModelForCausalLM

    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(str(out_dir))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out_dir / f.name)


def build_all(out_dir: str) -> dict[str, str]:
    """Builds the tokenizer and every tiny model under `out_dir`; returns name -> model folder."""
    torch.set_num_threads(1)
    out = Path(out_dir)
    tok_dir = out / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tok_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    paths: dict[str, str] = {}
    for seed, (name, config) in enumerate(model_specs(len(tokenizer), eos_id, pad_id).items()):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        build_model(name, config, seed, folder, tok_dir)
        paths[name] = str(folder)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args()
    for name, path in build_all(args.out).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
