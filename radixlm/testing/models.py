"""Pieces for synthesizing offline models: ChatML special tokens and a byte-level BPE trainer.

    tok = train_bpe_tokenizer(stdlib_texts(3_000_000), vocab_size=2000)   # HF fast tokenizer
    tok.save_pretrained(folder)

Used by scripts/make_tiny_models.py (the test models), scripts/train_demo_model.py (the bundled
demo model) and the benchmarks' model synthesis. Everything is deterministic and offline: the
training text is this interpreter's standard library source, read in name order.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from radixlm.runtime.entrypoints.chat_template import CHAT_TEMPLATES

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0, 1, 2 of every trained vocab
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = CHAT_TEMPLATES["chatml"]


def stdlib_texts(max_bytes: int) -> Iterator[str]:
    """Yields the text of the stdlib's .py files (sorted, so deterministic) until `max_bytes`
    characters were read; undecodable bytes are dropped."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="ignore")
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, split_digits: bool = False,
                        pad_vocab_to: int | None = None) -> Any:
    """Trains a byte-level BPE (ChatML specials first, `<|im_end|>` as eos, `<|endoftext|>` as
    pad, the ChatML chat template) and returns it as a transformers PreTrainedTokenizerFast.

    `split_digits` makes every digit its own token. `pad_vocab_to` appends `<extra_N>` tokens until
    the vocabulary has exactly that many entries, so every id a random model samples decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if pad_vocab_to is not None:
        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        for i in range(len(vocab), pad_vocab_to):
            vocab[f"<extra_{i}>"] = i
        tok = Tokenizer.from_str(json.dumps(data))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                     additional_special_tokens=SPECIAL_TOKENS)
    hf_tok.chat_template = CHATML_TEMPLATE
    return hf_tok
