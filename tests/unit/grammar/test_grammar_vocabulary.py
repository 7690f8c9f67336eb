"""runtime/constrained/vocabulary.py: token bytes tables and the outlines-core Vocabulary."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.constrained import build_vocabulary, token_bytes_table


# ---------------------------------------------------------------------------------------- vocabulary
def test_vocabulary_round_trip(grammar_tokenizer: Any, vocab_size: int) -> None:
    table = token_bytes_table(grammar_tokenizer, vocab_size)
    special = set(grammar_tokenizer.all_special_ids) | {
        i for i, t in grammar_tokenizer.added_tokens_decoder.items() if t.special
    }
    assert all(table[i] is None for i in special)
    assert all(b is None for b in table[len(grammar_tokenizer) :])
    checked = 0
    for tid, raw in enumerate(table):
        if raw is None:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a partial UTF-8 piece; covered by the encode round trip below
        assert grammar_tokenizer.decode([tid]) == text, (tid, raw)
        checked += 1
    assert checked > 0.8 * (len(grammar_tokenizer) - len(special))
    for text in ["def f(x):\n    return x + 1", 'héllo wörld 中文 {"a": [1, 2.5]}', "\t tabs  and\r\n lines"]:
        ids = grammar_tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(table[t] for t in ids) == text.encode("utf-8")
    vocab = build_vocabulary(grammar_tokenizer, vocab_size)
    assert vocab.get_eos_token_id() == grammar_tokenizer.eos_token_id
    assert vocab.get(b"{") == [grammar_tokenizer.convert_tokens_to_ids("{")]


def test_sentencepiece_style_tokens() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = {"<unk>": 0, "</s>": 1, "<0x0A>": 2, "<0xE4>": 3, "\u2581a": 4, "b": 5, "\u2581": 6}
    tok = Tokenizer(models.BPE(vocab=pieces, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    table = token_bytes_table(fast, 8)
    assert table[:8] == [None, None, b"\n", b"\xe4", b" a", b"b", b" ", None]
