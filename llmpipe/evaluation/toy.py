"""A small trained language model on a synthetic corpus, for tests and benchmarks (CPU, seconds).

Perplexity, bits-per-byte and quantization error only mean something on a model that has learnt
something, so the tests train a tiny Llama on templated sentences (two languages, seeded) instead
of scoring random weights. Nothing here is used by the pipeline stages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_WORDS = {
    "en": (["the cat", "a dog", "my friend", "the teacher", "our neighbour", "a child"],
           ["sees", "likes", "finds", "paints", "follows", "hears"],
           ["the red ball", "a small house", "the old tree", "a blue bird", "the river", "a long road"]),
    "de": (["die Katze", "ein Hund", "mein Freund", "der Lehrer", "unser Nachbar", "ein Kind"],
           ["sieht", "mag", "findet", "malt", "folgt", "hört"],
           ["den roten Ball", "ein kleines Haus", "den alten Baum", "einen blauen Vogel", "den Fluss",
            "einen langen Weg"]),
}
EOS, PAD = "<|endoftext|>", "<|pad|>"


def corpus(n_docs: int, seed: int = 0, langs: tuple[str, ...] = ("en", "de")) -> list[tuple[str, str]]:
    """(lang, text) documents of 2-5 templated sentences each: learnable, not trivial."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        lang = langs[i % len(langs)]
        subj, verb, obj = _WORDS[lang]
        sents = [f"{rng.choice(subj).capitalize()} {rng.choice(verb)} {rng.choice(obj)}."
                 for _ in range(rng.randint(2, 5))]
        docs.append((lang, " ".join(sents)))
    return docs


def train_tokenizer(texts: list[str], vocab_size: int = 400) -> Any:
    """A byte-level BPE wrapped as a ``transformers`` fast tokenizer (eos and a distinct pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)


def pack(tokenizer: Any, docs: list[tuple[str, str]], seq_len: int) -> list[tuple[str, np.ndarray]]:
    """Per-language packed sequences of ``seq_len`` tokens (documents joined by end-of-text; the
    last partial sequence of each language is right-padded)."""
    out = []
    for lang in sorted({lg for lg, _ in docs}):
        stream: list[int] = []
        for lg, text in docs:
            if lg == lang:
                stream += tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        for i in range(0, len(stream), seq_len):
            chunk = stream[i : i + seq_len]
            if len(chunk) > 1:
                chunk = chunk + [tokenizer.pad_token_id] * (seq_len - len(chunk))
                out.append((lang, np.asarray(chunk, dtype=np.int64)))
    return out


@dataclass
class ToyModel:
    path: Path  # save_pretrained directory with the tokenizer in it
    train: list[tuple[str, np.ndarray]]
    val: list[tuple[str, np.ndarray]]
    final_loss: float


def build(out_dir: str | Path, *, hidden: int = 64, intermediate: int = 176, layers: int = 2, steps: int = 150,
          seq_len: int = 64, n_docs: int = 600, seed: int = 0, lr: float = 3e-3) -> ToyModel:
    """Train a tiny Llama for ``steps`` AdamW steps and save it (model + tokenizer) to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    docs = corpus(n_docs, seed)
    n_val = max(2, n_docs // 10)
    tok = train_tokenizer([t for _, t in docs[n_val:]])
    train, val = pack(tok, docs[n_val:], seq_len), pack(tok, docs[:n_val], seq_len)
    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=max(128, seq_len), tie_word_embeddings=False,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(conf)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = torch.as_tensor(np.stack([s for _, s in train]))
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = data[torch.randint(0, len(data), (16,), generator=gen)]
        labels = x.masked_fill(x == tok.pad_token_id, -100)
        loss = model(input_ids=x, attention_mask=(x != tok.pad_token_id).long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return ToyModel(out_dir, train, val, float(loss))
