"""Trains the bundled demo model (`radixlm/demo_model/`) on CPU from a synthetic, checkable corpus.

    python scripts/train_demo_model.py --out radixlm/demo_model --minutes 12 --seed 0

The corpus is generated here (fixed split seed), chat-formatted with ChatML, and covers four tasks:
small-integer arithmetic (0-50, + and -), capital-of-X lookups from the table below, copying and
reversing short words, and emitting small JSON objects. A slice of it is plain "Q: ... / A: ..."
few-shot text so DSL few-shot programs work too. Each task holds out a split that training never
sees (arithmetic pairs, country/phrasing pairs, words, names); greedy accuracy on it is measured with
HF transformers at the end and written, with the size and training time, into `MODEL_CARD.md`.
The tokenizer is a byte-level BPE trained here (digits split one by one, ChatML specials, eos
`<|im_end|>`); the model is a small `LlamaForCausalLM` saved as fp32 safetensors. Loss is taken on
assistant (answer) tokens only.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlm.testing.models import train_bpe_tokenizer

VOCAB_SIZE = 768
SPLIT_SEED = 20240601  # fixes the held-out split; independent of --seed
MODEL_CONFIG = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                    num_key_value_heads=3, max_position_embeddings=1024, rms_norm_eps=1e-6,
                    initializer_range=0.02, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

CAPITALS: dict[str, str] = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Brazil": "Brasilia",
    "Argentina": "Buenos Aires", "Mexico": "Mexico City", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Nigeria": "Abuja", "Russia": "Moscow", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Poland": "Warsaw", "Austria": "Vienna", "Greece": "Athens", "Turkey": "Ankara",
    "Ireland": "Dublin", "Peru": "Lima", "Chile": "Santiago", "Colombia": "Bogota", "Cuba": "Havana",
    "Australia": "Canberra", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Iran": "Tehran", "Iraq": "Baghdad",
    "Hungary": "Budapest", "Belgium": "Brussels", "Netherlands": "Amsterdam", "Switzerland": "Bern",
    "Ukraine": "Kyiv", "Morocco": "Rabat", "Ghana": "Accra", "Ethiopia": "Addis Ababa", "Indonesia": "Jakarta",
    "Philippines": "Manila", "South Korea": "Seoul", "Pakistan": "Islamabad", "Iceland": "Reykjavik",
    "Czechia": "Prague", "Romania": "Bucharest", "New Zealand": "Wellington", "Scotland": "Edinburgh",
    "Wales": "Cardiff", "England": "London", "Venezuela": "Caracas", "Nepal": "Kathmandu", "Qatar": "Doha",
}
NAMES = [
    "Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar",
    "Peggy", "Trent", "Victor", "Walter", "Ada", "Alan", "Linus", "Maria", "John", "Emma", "Liam",
    "Olivia", "Noah", "Ava", "Mia", "Lucas", "Sofia", "Mateo", "Chloe", "Omar", "Fatima", "Yuki", "Kenji",
    "Priya", "Ravi", "Lena", "Hugo", "Nina", "Paul", "Rosa", "Sam", "Tara", "Umar", "Vera", "Zoe", "Igor",
    "Anna", "Ben", "Clara", "Dan", "Elsa", "Felix", "Gina", "Hans", "Iris", "Jack", "Kira", "Leo", "Mona",
]
ARITH_TEMPLATES = {"+": ["What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} =", "What is {a} plus {b}?"],
                   "-": ["What is {a} - {b}?", "Compute {a} - {b}.", "{a} - {b} =", "What is {a} minus {b}?"]}
CAPITAL_TEMPLATES = ["What is the capital of {c}?", "What's the capital city of {c}?", "Name the capital of {c}.",
                     "Which city is the capital of {c}?", "Capital of {c}?"]
COPY_TEMPLATES = ["Repeat the word: {w}", "Copy this word: {w}", "Say {w}"]
REVERSE_TEMPLATES = ["Reverse the word: {w}", "Spell {w} backwards.", "Write {w} in reverse."]
JSON_TEMPLATES = [("Give a JSON object with name {name} and age {age}", ("name", "age")),
                  ("Give a JSON object with name {name}, age {age} and city {city}", ("name", "age", "city")),
                  ("Return JSON with name {name} and age {age}.", ("name", "age")),
                  ("Make a JSON object: name {name}, city {city}", ("name", "city"))]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a tiny demo model. Answer briefly.",
                  "Answer the question with just the answer."]
CHITCHAT = {
    "Hello": "Hello! I am the radixlm demo model. Ask me some arithmetic, a capital, or a JSON object.",
    "Hi!": "Hi! I can add and subtract small numbers, name capitals, copy or reverse words, and write JSON.",
    "Who are you?": "I am a tiny Llama-style demo model shipped with radixlm.",
    "What can you do?": "I can add and subtract numbers up to 50, name capitals, copy or reverse words, "
                        "and write small JSON objects.",
}
TASK_WEIGHTS = {"arithmetic": 0.45, "capital": 0.13, "copy": 0.1, "reverse": 0.15, "json": 0.15, "chitchat": 0.02}


# ----------------------------------------------------------------- the split
@dataclass(frozen=True)
class Split:
    """Which items each task may train on; the rest is the held-out split."""

    arith_train: list[tuple[int, str, int]]
    arith_heldout: list[tuple[int, str, int]]
    capital_train: list[tuple[str, int]]          # (country, template index)
    capital_heldout: list[tuple[str, int]]
    words_train: list[str]
    words_heldout: list[str]
    names_train: list[str]
    names_heldout: list[str]


def random_words(rng: random.Random, count: int) -> list[str]:
    """`count` distinct lowercase words of 3-6 letters, alternating consonant/vowel-ish letters."""
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    words: set[str] = set()
    while len(words) < count:
        length = rng.randint(3, 6)
        start = rng.random() < 0.5
        words.add("".join(rng.choice(consonants if (i % 2 == 0) == start else vowels) for i in range(length)))
    return sorted(words)


def make_split() -> Split:
    """The fixed train/held-out split (SPLIT_SEED): about 10% of each task's items are held out."""
    rng = random.Random(SPLIT_SEED)
    pairs = [(a, "+", b) for a in range(51) for b in range(51)] + [(a, "-", b) for a in range(51) for b in range(a + 1)]
    rng.shuffle(pairs)
    cut = len(pairs) // 10
    combos = [(c, t) for c in CAPITALS for t in range(len(CAPITAL_TEMPLATES))]
    heldout_combos = [(c, rng.randrange(len(CAPITAL_TEMPLATES))) for c in CAPITALS]
    words = random_words(rng, 3000)
    rng.shuffle(words)
    names = list(NAMES)
    rng.shuffle(names)
    return Split(arith_train=pairs[cut:], arith_heldout=pairs[:cut],
                 capital_train=[x for x in combos if x not in heldout_combos], capital_heldout=heldout_combos,
                 words_train=words[300:], words_heldout=words[:300],
                 names_train=names[6:], names_heldout=names[:6])


# ----------------------------------------------------------------- question/answer generators
def arith_qa(rng: random.Random, item: tuple[int, str, int], template: int | None = None) -> tuple[str, str]:
    a, op, b = item
    templates = ARITH_TEMPLATES[op]
    if template is None:  # the main phrasing half the time: fewer layouts to learn
        template = 0 if rng.random() < 0.5 else rng.randrange(len(templates))
    return templates[template].format(a=a, b=b), str(a + b if op == "+" else a - b)


def capital_qa(item: tuple[str, int]) -> tuple[str, str]:
    country, template = item
    return CAPITAL_TEMPLATES[template].format(c=country), CAPITALS[country]


def word_qa(rng: random.Random, word: str, reverse: bool) -> tuple[str, str]:
    templates = REVERSE_TEMPLATES if reverse else COPY_TEMPLATES
    return rng.choice(templates).format(w=word), word[::-1] if reverse else word


def json_qa(rng: random.Random, name: str, template: int | None = None) -> tuple[str, str]:
    text, keys = JSON_TEMPLATES[rng.randrange(len(JSON_TEMPLATES)) if template is None else template]
    values = {"name": name, "age": rng.randint(1, 99), "city": rng.choice(list(CAPITALS.values()))}
    return text.format(**values), json.dumps({key: values[key] for key in keys})


def train_qa(rng: random.Random, split: Split, task: str) -> tuple[str, str]:
    """One training (question, answer) pair of `task`, drawn from the train split only."""
    if task == "arithmetic":
        return arith_qa(rng, rng.choice(split.arith_train))
    if task == "capital":
        return capital_qa(rng.choice(split.capital_train))
    if task in ("copy", "reverse"):
        return word_qa(rng, rng.choice(split.words_train), reverse=task == "reverse")
    if task == "json":  # made-up names too, so that the model learns to copy any name
        name = rng.choice(split.names_train) if rng.random() < 0.5 else rng.choice(split.words_train).title()
        return json_qa(rng, name)
    question = rng.choice(list(CHITCHAT))
    return question, CHITCHAT[question]


def heldout_qa(split: Split, per_task: int) -> dict[str, list[tuple[str, str]]]:
    """Held-out (question, answer) pairs per task, in each task's main phrasing where it has one."""
    rng = random.Random(SPLIT_SEED + 1)
    out = {"arithmetic": [arith_qa(rng, item, template=0) for item in split.arith_heldout[:per_task]],
           "capital": [capital_qa(item) for item in split.capital_heldout[:per_task]],
           "copy": [word_qa(rng, w, reverse=False) for w in split.words_heldout[:per_task]],
           "reverse": [word_qa(rng, w, reverse=True) for w in split.words_heldout[:per_task]],
           "json": [json_qa(rng, split.names_heldout[i % len(split.names_heldout)], template=0)
                    for i in range(per_task)]}
    return out


# ----------------------------------------------------------------- rendering (text + answer spans)
Spans = list[tuple[int, int]]


def render_chat(rng: random.Random, turns: list[tuple[str, str]]) -> tuple[str, Spans]:
    """ChatML text of a conversation and the character spans the loss is taken on (answers + eos)."""
    text, spans = "", []
    if rng.random() < 0.2:
        text += f"<|im_start|>system\n{rng.choice(SYSTEM_PROMPTS)}<|im_end|>\n"
    for question, answer in turns:
        text += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        answer_text = f"{answer}<|im_end|>"
        spans.append((len(text), len(text) + len(answer_text)))
        text += answer_text + "\n"
    return text, spans


def render_fewshot(rng: random.Random, turns: list[tuple[str, str]]) -> tuple[str, Spans]:
    """Plain few-shot text, 'Q: ...\\nA: ...\\n' blocks; the loss covers ' answer\\n'."""
    q_tag, a_tag = rng.choice([("Q:", "A:"), ("Question:", "Answer:")])
    text, spans = rng.choice(["", "Answer the questions.\n", "The following are questions with answers.\n\n"]), []
    for question, answer in turns:
        text += f"{q_tag} {question}\n{a_tag}"
        spans.append((len(text), len(text) + len(answer) + 2))
        text += f" {answer}\n"
    return text, spans


def sample_document(rng: random.Random, split: Split) -> tuple[str, Spans]:
    """One training document: a 1-4 turn chat (85%) or a 2-5 shot plain Q/A text (15%)."""
    tasks, weights = list(TASK_WEIGHTS), list(TASK_WEIGHTS.values())
    fewshot = rng.random() < 0.15
    count = rng.randint(2, 5) if fewshot else rng.choice([1, 1, 2, 3, 4])
    same_task = rng.random() < 0.5
    first = rng.choices(tasks, weights)[0]
    turns = [train_qa(rng, split, first if same_task else rng.choices(tasks, weights)[0]) for _ in range(count)]
    return render_fewshot(rng, turns) if fewshot else render_chat(rng, turns)


# ----------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str]):
    """Byte-level BPE with digits split one by one; returns an HF PreTrainedTokenizerFast (ChatML)."""
    return train_bpe_tokenizer(texts, VOCAB_SIZE, split_digits=True)


def encode_documents(tokenizer, docs: list[tuple[str, Spans]]) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per document; labels are -100 outside the answer spans."""
    encodings = tokenizer([text for text, _ in docs], add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for (_, spans), ids, offsets in zip(docs, encodings["input_ids"], encodings["offset_mapping"]):
        labels = [tid if any(lo <= start < hi for lo, hi in spans) else -100
                  for tid, (start, _) in zip(ids, offsets)]
        out.append((ids, labels))
    return out


# ----------------------------------------------------------------- training
def pack_rows(encoded: list[tuple[list[int], list[int]]], row_len: int) -> list[tuple[list[int], list[int]]]:
    """Concatenates whole documents into rows of at most `row_len` tokens (no padding inside a row)."""
    rows: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    for doc_ids, doc_labels in encoded:
        if ids and len(ids) + len(doc_ids) > row_len:
            rows.append((ids, labels))
            ids, labels = [], []
        ids, labels = ids + doc_ids[:row_len], labels + doc_labels[:row_len]
    return rows


def make_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of packed rows; labels are shifted by the model (HF convention). Causal
    attention alone keeps real tokens from seeing the padding, so no attention mask is needed."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (ids, lab) in enumerate(rows):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(lab)] = torch.tensor(lab)
    return {"input_ids": input_ids, "labels": labels}


def learning_rate(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.05) -> float:
    """Linear warm-up, then cosine decay to `floor * peak`; `progress` runs from 0 to 1."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))
    return peak * (floor + (1 - floor) * cosine)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    final_loss: float
    tokens: int


def batches(rng: random.Random, split: Split, tokenizer, rows: int, row_len: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of `rows` packed rows; every document is freshly sampled from the train split."""
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    while True:
        docs = [sample_document(rng, split) for _ in range(rows * row_len // 16)]
        packed = pack_rows(encode_documents(tokenizer, docs), row_len)[:-1]  # the last row is partly empty
        for i in range(0, len(packed) - rows + 1, rows):
            yield make_batch(packed[i:i + rows], pad_id)


def progress_of(args: argparse.Namespace, step: int, elapsed: float) -> float:
    """How far training is, 0 to 1: by steps with --steps, else by wall time against --minutes."""
    return step / args.steps if args.steps is not None else elapsed / (60 * args.minutes)


def train(model, data: Iterator[dict[str, torch.Tensor]], args: argparse.Namespace) -> TrainResult:
    """AdamW (no decay on norms), warm-up + cosine LR, bf16 autocast, grad clip 1; stops at progress 1."""
    from tqdm import tqdm

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.99), eps=1e-8)
    model.train()
    start, step, smooth = time.monotonic(), 0, float("nan")
    bar = tqdm(total=1000, desc="training", unit="‰", dynamic_ncols=True, mininterval=0.5)
    while (progress := progress_of(args, step, time.monotonic() - start)) < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(progress, args.lr)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(**next(data)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        smooth = loss.item() if math.isnan(smooth) else 0.98 * smooth + 0.02 * loss.item()
        bar.update(int(progress * 1000) - bar.n)
        bar.set_postfix(step=step, loss=f"{smooth:.4f}", lr=f"{optimizer.param_groups[0]['lr']:.2e}")
    bar.update(1000 - bar.n)
    bar.close()
    model.eval()
    return TrainResult(steps=step, seconds=time.monotonic() - start, final_loss=smooth,
                       tokens=step * args.batch_size * args.row_len)


# ----------------------------------------------------------------- evaluation
def fewshot_prompts(split: Split, items: list[tuple[str, str]], shots: int = 3) -> list[tuple[str, str]]:
    """Plain 'Q:/A:' prompts: `shots` train-split arithmetic examples, then the held-out question."""
    rng = random.Random(SPLIT_SEED + 2)
    out = []
    for question, answer in items:
        examples = [arith_qa(rng, rng.choice(split.arith_train), template=0) for _ in range(shots)]
        text = "".join(f"Q: {q}\nA: {a}\n" for q, a in examples)
        out.append((f"{text}Q: {question}\nA:", answer))
    return out


@torch.inference_mode()
def greedy_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                   batch_size: int = 64) -> list[str]:
    """HF greedy generation (left-padded batches); returns the decoded text up to the first stop id."""
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    texts = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop_ids, pad_token_id=pad_id)
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in stop_ids), len(row))
            texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return texts


def evaluate(model, tokenizer, split: Split, per_task: int) -> dict[str, dict[str, object]]:
    """Greedy exact-match accuracy per task on the held-out split (chat prompts), plus few-shot text."""
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline_ids = [tid for tok, tid in tokenizer.get_vocab().items() if tok.startswith("Ċ")]
    results: dict[str, dict[str, object]] = {}
    for task, items in heldout_qa(split, per_task).items():
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for q, _ in items]
        answers = greedy_answers(model, tokenizer, prompts, 48, [eos_id])
        results[task] = score(items, answers)
    items = fewshot_prompts(split, heldout_qa(split, per_task)["arithmetic"])
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in items]
    answers = [a.strip() for a in greedy_answers(model, tokenizer, prompts, 8, [eos_id, *newline_ids])]
    results["arithmetic (plain few-shot Q:/A: text)"] = score(items, answers)
    return results


def score(items: list[tuple[str, str]], answers: list[str]) -> dict[str, object]:
    correct = sum(a == expected for (_, expected), a in zip(items, answers))
    wrong = [(q, e, a) for (q, e), a in zip(items, answers) if a != e][:3]
    return {"correct": correct, "total": len(items), "accuracy": correct / max(1, len(items)), "wrong_examples": wrong}


# ----------------------------------------------------------------- saving and the model card
def build_model(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(**MODEL_CONFIG, vocab_size=len(tokenizer), eos_token_id=eos_id, bos_token_id=pad_id,
                         pad_token_id=pad_id)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.do_sample = False
    return model


def write_model_card(out: Path, model, result: TrainResult, evals: dict[str, dict[str, object]],
                     args: argparse.Namespace, command: str) -> None:
    params = sum(p.numel() for p in model.parameters())
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    cfg = model.config
    rows = "\n".join(f"| {task} | {r['correct']}/{r['total']} | {100 * r['accuracy']:.1f}% |" for task, r in evals.items())
    card = f"""# radixlm demo model

A tiny Llama-style chat model trained from scratch on CPU by `scripts/train_demo_model.py`, so that the
radixlm server has something meaningful to serve offline (`radixlm-server` with no `--model-path`).
It knows only its synthetic training tasks; it is not a general assistant.

- **Architecture:** `LlamaForCausalLM`, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size},
  {cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads (head_dim {cfg.hidden_size // cfg.num_attention_heads}),
  tied embeddings, rope theta 10000, vocab {cfg.vocab_size}.
  **{params:,} parameters**, fp32 safetensors of **{size_mb:.1f} MB**.
- **Tokenizer:** byte-level BPE trained by the script, digits split one by one, specials `<|endoftext|>`
  (pad), `<|im_start|>`, `<|im_end|>` (eos). ChatML chat template (`chat_template.jinja`).
- **Training data:** generated by the script (split seed {SPLIT_SEED}): chat conversations of 1-4 turns
  (20% with a system prompt) and 15% plain `Q: ... / A: ...` few-shot text. Tasks: addition and subtraction
  of integers 0-50 (subtraction with a non-negative result); "capital of X" for the {len(CAPITALS)} countries in
  the script's table, in {len(CAPITAL_TEMPLATES)} phrasings; copying and reversing made-up 3-6 letter words;
  small JSON objects (`{{"name": ..., "age": ...}}`, optionally `city`); a few greetings. Loss on answer tokens only.
- **Training run:** {result.steps:,} steps of {result.tokens // max(1, result.steps):,} tokens (packed rows;
  {result.tokens / 1e6:.1f}M tokens in all), AdamW (peak LR {args.lr:g}), {"bf16 autocast" if args.bf16 else "fp32"},
  warm-up + cosine LR, seed {args.seed}: {result.seconds / 60:.1f} minutes on a shared {platform.machine()} CPU
  with {args.threads} torch thread(s); final training loss {result.final_loss:.4f}.

## Held-out accuracy (greedy, exact match, measured with HF transformers after training)

The held-out split is never trained on: 10% of the arithmetic pairs, one (country, phrasing) pair per
country, 300 of the made-up words, and 6 of the names used in JSON objects.

| task | correct | accuracy |
|---|---|---|
{rows}

Prompts are the chat template with one user message in the task's main phrasing
("What is 17 + 25?", "What is the capital of France?" style, "Repeat the word: ...", "Reverse the word: ...",
"Give a JSON object with name Alice and age 30"); the few-shot row is plain text with three solved examples.

## Reproduce

```
{command}
```
"""
    (out / "MODEL_CARD.md").write_text(card)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="radixlm/demo_model", help="output model folder")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=12.0, help="training wall-time budget (default 12)")
    budget.add_argument("--steps", type=int, default=None, help="train a fixed number of steps instead")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data order and the initial weights")
    parser.add_argument("--batch-size", type=int, default=12, help="packed rows per step")
    parser.add_argument("--row-len", type=int, default=256, help="tokens per packed row")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 is much faster than 2 when other work shares the cores")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false",
                        help="train in plain fp32 instead of bf16 autocast (weights are fp32 either way)")
    parser.add_argument("--eval-per-task", type=int, default=200, help="held-out prompts per task")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    split, rng = make_split(), random.Random(args.seed)
    tokenizer = train_tokenizer([sample_document(rng, split)[0] for _ in range(20000)])
    model = build_model(tokenizer, args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters; vocab {len(tokenizer)}", flush=True)
    result = train(model, batches(rng, split, tokenizer, args.batch_size, args.row_len), args)
    print(f"trained {result.steps} steps in {result.seconds:.0f} s, loss {result.final_loss:.4f}", flush=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    evals = evaluate(model, tokenizer, split, args.eval_per_task)
    for task, r in evals.items():
        print(f"{task}: {r['correct']}/{r['total']} = {100 * r['accuracy']:.1f}%  wrong e.g. {r['wrong_examples']}")
    command = "python scripts/train_demo_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_model_card(out, model, result, evals, args, command)


if __name__ == "__main__":
    main()
