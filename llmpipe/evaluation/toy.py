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


@dataclass
class ToyArtifacts:
    """Real upstream artifacts (made by the real tokenizer and tokenize stages) plus a trained model."""

    store: Path
    augment: Path
    tokenizer: Path
    tokenize: Path
    pretrain: Path  # save_pretrained directory with the tokenizer in it, like the pretrain stage's export
    final_loss: float


def _context(name: str, config: Any, inputs: dict[str, Path], out: Path, store: Any) -> Any:
    from llmpipe.stage import STAGES, LocalRunner, StageContext

    out.mkdir(parents=True, exist_ok=True)
    return StageContext(spec=STAGES[name], config=config, pipeline=None, key=f"toy-{name}", out=out,
                        inputs=inputs, input_keys={k: f"toy-{k}" for k in inputs}, store=store,
                        runner=LocalRunner(1))


def build(root: str | Path, *, hidden: int = 64, intermediate: int = 176, layers: int = 2, steps: int = 120,
          seq_len: int = 64, n_docs: int = 600, vocab_size: int = 400, seed: int = 0, lr: float = 3e-3,
          batch: int = 16) -> ToyArtifacts:
    """Curated shards -> tokenizer stage -> tokenize stage -> a tiny Llama trained ``steps`` AdamW steps."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llmpipe.document import SHARDS, Document, write_shard
    from llmpipe.store import ArtifactStore
    from llmpipe.tokenization.config import TokenizeConfig, TokenizerConfig
    from llmpipe.tokenization.dataset import PackedDataset
    from llmpipe.tokenization.pack import run_tokenize
    from llmpipe.tokenization.tokenizer import run_tokenizer

    root = Path(root)
    store = ArtifactStore(root / "store")
    docs = [Document(f"d{i}", text, "toy", {"lang": lang}) for i, (lang, text) in enumerate(corpus(n_docs, seed))]
    aug, tok_dir, tz, pre = root / "augment", root / "tokenizer", root / "tokenize", root / "pretrain"
    for k in range(2):
        write_shard(aug / SHARDS / f"part-{k:03d}.parquet", docs[k::2])
    run_tokenizer(_context("tokenizer", TokenizerConfig(vocab_size=vocab_size), {"augment": aug}, tok_dir, store))
    run_tokenize(_context("tokenize", TokenizeConfig(seq_len=seq_len, val_fraction=0.1, sequences_per_shard=64),
                          {"augment": aug, "tokenizer": tok_dir}, tz, store))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    train = PackedDataset(tz, "train")
    data = torch.stack([train[i] for i in range(len(train))])
    torch.manual_seed(seed)
    conf = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=max(128, seq_len + 1), tie_word_embeddings=False,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(conf)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        x = data[torch.randint(0, len(data), (batch,), generator=gen)]
        labels = x.masked_fill(x == tok.pad_token_id, -100)
        loss = model(input_ids=x, attention_mask=(x != tok.pad_token_id).long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(pre)
    tok.save_pretrained(pre)
    return ToyArtifacts(root / "store", aug, tok_dir, tz, pre, float(loss.detach()))
