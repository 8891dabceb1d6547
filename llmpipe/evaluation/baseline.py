"""The reference point of the evaluation: a unigram model of the training tokens.

A language model's bits per byte mean little alone: 3.4 bpb is good for a byte-level model on
Chinese and poor for a BPE model on English. The unigram model -- every token drawn independently
with its frequency in the ``train`` split of the tokenize artifact -- knows the vocabulary and the
word frequencies but no context, so the ratio ``model bpb / unigram bpb`` says how much of what the
model learnt is *context*: about 1.0 for a model that learnt nothing beyond word frequencies, lower
is better.

Counts are the real (unpadded) ids of the train shards, i.e. the mixture the model trained on, with
add-one smoothing over every id of the vocabulary (a held-out token never seen in training still
gets a finite cost, as it does under the model's softmax). It is scored through
:func:`llmpipe.evaluation.metrics.tally_sequences`, the code path of the model's numbers, so both
cover exactly the same targets and the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.evaluation.data import split_token_arrays
from llmpipe.evaluation.metrics import EvalSequence, Scorer, tally_sequences
from llmpipe.tokenization.layout import TOKENIZE

SMOOTHING = 1.0  # add-one (Laplace)


def train_token_counts(tokenize_dir: str | Path, split: str = "train") -> np.ndarray:
    """How often each id occurs among the real tokens of ``split`` (indexed by id, ``vocab_size`` long)."""
    index, arrays = split_token_arrays(tokenize_dir, split)
    vocab = int(index["vocab_size"])
    counts = np.zeros(vocab, dtype=np.int64)
    for ids in arrays:
        counts += np.bincount(np.asarray(ids), minlength=vocab)[:vocab]
    return counts


def unigram_log_probs(counts: np.ndarray, smoothing: float = SMOOTHING, vocab: int | None = None) -> np.ndarray:
    """Natural-log probabilities ``log((c_i + k) / (N + k V))`` over ``vocab`` ids (default: ``len(counts)``)."""
    vocab = len(counts) if vocab is None else vocab
    if vocab < len(counts):
        raise ValueError(f"unigram baseline: vocab {vocab} is smaller than the {len(counts)} counted ids")
    c = np.zeros(vocab, dtype=np.float64)
    c[: len(counts)] = counts
    return np.log(c + smoothing) - np.log(c.sum() + smoothing * vocab)


def unigram_scorer(log_probs: np.ndarray, pad_id: int | None, byte_len: np.ndarray) -> Scorer:
    """A scorer for :func:`tally_sequences`: per-target columns of one batch under the unigram model."""
    best = int(np.argmax(log_probs))

    def score(batch: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
        out = []
        for s in batch:
            ids = np.asarray(s, dtype=np.int64)
            valid = np.ones(len(ids), dtype=bool) if pad_id is None else ids != pad_id
            target = ids[1:]
            out.append({"nll": -log_probs[target], "correct": target == best, "bytes": byte_len[target],
                        "scored": valid[1:] & valid[:-1]})
        return out

    return score


def unigram_metrics(sequences: Sequence[EvalSequence], counts: np.ndarray, pad_id: int | None,
                    byte_len: np.ndarray, language_names: Sequence[str] = (),
                    smoothing: float = SMOOTHING) -> dict[str, Any]:
    """Overall and per-language metrics of the add-``smoothing`` unigram model on ``sequences``.

    ``byte_len`` spans the model's vocabulary (ids the tokenizer never produces spell 0 bytes), and
    so does the unigram distribution, like the model's softmax.
    """
    log_probs = unigram_log_probs(counts, smoothing, vocab=max(len(counts), len(byte_len)))
    res = tally_sequences(sequences, unigram_scorer(log_probs, pad_id, byte_len), batch_size=64,
                          language_names=language_names)
    res["train_tokens"] = int(counts.sum())
    res["smoothing"] = f"add-{smoothing:g}"
    res["vocab_size"] = len(log_probs)
    return res


def bpb_ratio(model_bpb: float, unigram_bpb: float) -> float | None:
    """Model bits per byte over the unigram's (lower is better; ~1.0: nothing learnt beyond frequencies)."""
    if not unigram_bpb or unigram_bpb != unigram_bpb or model_bpb != model_bpb:
        return None
    return model_bpb / unigram_bpb


# -- the n-gram baseline ---------------------------------------------------------------------------------
def train_documents(tokenize_dir: str | Path, split: str = "train", max_tokens: int | None = None
                    ) -> list[np.ndarray]:
    """Documents of ``split`` (every ``step``-th one, so about ``max_tokens`` tokens spread over the
    whole split): what the n-gram baseline is estimated from."""
    from llmpipe.evaluation.documents import iter_documents

    index = json.loads((Path(tokenize_dir) / TOKENIZE.index).read_text())
    total = int(index["splits"].get(split, {}).get("tokens", 0))
    step = max(1, -(-total // max_tokens)) if max_tokens else 1
    return [d for i, d in enumerate(iter_documents(tokenize_dir, split)) if i % step == 0]


class KneserNey:
    """Interpolated Kneser-Ney over token ids, estimated by the coherence stage's estimator
    (:func:`llmpipe.curation.arpa.kneser_ney`: one absolute discount per order, continuation counts
    below the top order, the unigrams interpolated with a uniform distribution).

    A document is a sentence: its BOS and EOS ids are the model's ``<s>`` and ``</s>``. An id never
    seen in training gets ``<unk>``'s probability shared evenly among all unseen ids of the
    vocabulary, so the model is a distribution over the same ids as the softmax and the unigram.
    """

    def __init__(self, docs: Sequence[np.ndarray], order: int, vocab: int, eos_id: int, bos_id: int | None,
                 discount: float = 0.75) -> None:
        from llmpipe.curation.arpa import kneser_ney

        specials = {eos_id} | ({bos_id} if bos_id is not None else set())
        sents = ([str(t) for t in d.tolist() if t not in specials] for d in docs)
        prob, backoff = kneser_ney(sents, order, discount)
        self.order, self.eos_id, self.bos_id, self.discount = order, eos_id, bos_id, discount
        self.logp = {g: np.log(p) for n in range(1, order + 1) for g, p in prob[n].items() if p > 0}
        self.logb = {g: np.log(b) for n in range(1, order) for g, b in backoff[n].items() if b > 0}
        seen = sum(1 for g in prob[1] if g[0] not in ("<unk>", "</s>"))
        self.unseen = max(1, vocab - seen - len(specials))

    def word(self, history: Sequence[str], w: str) -> float:
        """Natural-log ``p(w | history)`` by the backoff rule (longest known context first)."""
        extra = 0.0
        if (w,) not in self.logp:
            w, extra = "<unk>", -float(np.log(self.unseen))
        ctx = tuple(history[-(self.order - 1):]) if self.order > 1 else ()
        for start in range(len(ctx) + 1):
            gram = (*ctx[start:], w)
            if gram in self.logp:
                return self.logp[gram] + sum(self.logb.get(ctx[s:], 0.0) for s in range(start)) + extra
        raise AssertionError("unreachable: every word has a unigram")

    def target_nll(self, ids: np.ndarray) -> np.ndarray:
        """NLL (nats) of ``ids[1:]``, each given the ids before it in ``ids`` back to the last document
        start (BOS or after EOS, read as ``<s>``); a BOS target right after EOS costs nothing."""
        out = np.zeros(max(0, len(ids) - 1))
        hist: list[str] = []
        ended = True  # a BOS here opens a document (BOS and EOS may be one id)
        for p, t in enumerate(ids.tolist()):
            if t == self.bos_id and (ended or self.bos_id != self.eos_id):
                hist, ended = ["<s>"], False  # costs nothing: out[p - 1] stays 0
                continue
            if p:
                out[p - 1] = -self.word(hist, "</s>" if t == self.eos_id else str(t))
            if t == self.eos_id:
                hist, ended = ["<s>"], True
            else:
                hist.append(str(t))
                del hist[: max(0, len(hist) - self.order)]
                ended = False
        return out

    def scorer(self, pad_id: int | None, byte_len: np.ndarray) -> Scorer:
        """A scorer for :func:`tally_sequences` (accuracy is not computed: ``correct`` is all False)."""
        def score(batch: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
            out = []
            for s in batch:
                ids = np.asarray(s, dtype=np.int64)
                valid = np.ones(len(ids), dtype=bool) if pad_id is None else ids != pad_id
                out.append({"nll": self.target_nll(ids), "correct": np.zeros(len(ids) - 1, dtype=bool),
                            "bytes": byte_len[ids[1:]], "scored": valid[1:] & valid[:-1]})
            return out

        return score


def kn_metrics(sequences: Sequence[EvalSequence], model: KneserNey, pad_id: int | None, byte_len: np.ndarray,
               language_names: Sequence[str] = ()) -> dict[str, Any]:
    """Overall and per-language bits per byte of the KN model on ``sequences`` (the unigram's targets)."""
    res = tally_sequences(sequences, model.scorer(pad_id, byte_len), batch_size=64, language_names=language_names)
    for m in (res["overall"], *res["per_language"].values()):
        m.pop("accuracy", None)
    res["smoothing"] = f"interpolated Kneser-Ney, order {model.order}, discount {model.discount:g}"
    res["order"] = model.order
    return res
