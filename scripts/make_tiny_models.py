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
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2000
TRAIN_BYTES = 3_000_000
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
COMMON_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    initializer_range=0.1,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)


def stdlib_texts(max_bytes: int = TRAIN_BYTES) -> Iterator[str]:
    """Yields the text of stdlib .py files (sorted, so deterministic) until `max_bytes` are read."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="ignore")
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def build_tokenizer(out_dir: Path):
    """Trains a byte-level BPE on stdlib source and saves it as an HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_texts(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
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
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
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
