"""The model recognizer: a transformers token-classification checkpoint, loaded by path.

Documents are tokenized once with offsets and word ids; long ones are read in windows of
``max_length`` tokens that share ``stride`` tokens, and a word seen in two windows takes the
prediction of the window where it sits further from an edge. Windows are batched by length across
documents (one forward pass per ``batch_size`` windows, little padding), which is what makes this
faster than calling the transformers ``pipeline`` document by document. A word's label is its first
sub-token's (the ``first`` aggregation); ``B-X``/``I-X`` (or plain ``X``) labels join consecutive
words into one entity whose score is the mean of its words' probabilities. Offsets come from the
tokenizer, so a span is an exact slice of the document text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmpipe.curation.entities.config import NerSettings
from llmpipe.curation.entities.spans import Span, make_span

_MODELS: dict[tuple[str, str], tuple[Any, Any]] = {}


def check_model_dir(path: str, what: str = "entities.ner.model") -> None:
    """Fail in the stage's parent, naming the config key, when the checkpoint is missing."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"{what}: no token-classification checkpoint at {path!r} (no config.json)")


def load(path: str, device: str) -> tuple[Any, Any]:
    """(fast tokenizer, model in eval mode), once per process."""
    key = (str(Path(path).resolve()), device)
    if key not in _MODELS:
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        if not tok.is_fast:
            raise ValueError(f"entities.ner.model: {path!r} has no fast tokenizer (offsets are needed)")
        model = AutoModelForTokenClassification.from_pretrained(path).to(device).eval()
        _MODELS[key] = (tok, model)
    return _MODELS[key]


def split_label(label: str) -> tuple[str, str | None]:
    """("B"|"I"|"O", entity type) of a model label: ``B-PER`` -> (B, PER), ``O`` -> (O, None), ``PER`` -> (I, PER)."""
    if label == "O" or not label:
        return "O", None
    if len(label) > 2 and label[1] in "-_" and label[0] in "BIES":
        return ("B" if label[0] in "BS" else "I"), label[2:]
    return "I", label


class TokenClassifier:
    """Entity spans from a token-classification model, batched across documents."""

    name = "ner"

    def __init__(self, settings: NerSettings, model_path: str) -> None:
        self.s = settings
        self.tok, self.model = load(model_path, settings.device)
        limit = min(settings.max_length, getattr(self.model.config, "max_position_embeddings", 512) or 512)
        self.max_length = int(min(limit, self.tok.model_max_length or limit))
        self.labels = {int(k): v for k, v in self.model.config.id2label.items()}
        self.keep = set(settings.labels)

    def recognize(self, texts: Sequence[str]) -> list[list[Span]]:
        if not texts:
            return []
        enc = self.tok(list(texts), truncation=True, max_length=self.max_length, stride=self.s.stride,
                       return_overflowing_tokens=True, return_offsets_mapping=True, padding=False)
        rows = len(enc["input_ids"])
        preds = self._predict(enc["input_ids"])
        words: list[dict[int, tuple[int, int, int, int, float]]] = [{} for _ in texts]
        for r in range(rows):
            doc = enc["overflow_to_sample_mapping"][r]
            self._words(enc, r, preds[r], words[doc])
        return [self._entities(t, w) for t, w in zip(texts, words, strict=True)]

    def _predict(self, ids: list[list[int]]) -> list[list[tuple[int, float]]]:
        """(label id, probability) per token of each row, rows batched by length."""
        import torch

        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[list[tuple[int, float]]] = [[] for _ in ids]
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        for b in range(0, len(order), self.s.batch_size):
            chunk = order[b : b + self.s.batch_size]
            width = max(len(ids[i]) for i in chunk)
            x = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, i in enumerate(chunk):
                x[j, : len(ids[i])] = torch.tensor(ids[i])
                mask[j, : len(ids[i])] = 1
            with torch.no_grad():
                logits = self.model(input_ids=x.to(self.s.device), attention_mask=mask.to(self.s.device)).logits
            prob, lab = logits.float().softmax(-1).max(-1)
            for j, i in enumerate(chunk):
                n = len(ids[i])
                out[i] = list(zip(lab[j, :n].tolist(), prob[j, :n].tolist(), strict=True))
        return out

    def _words(self, enc: Any, r: int, pred: list[tuple[int, float]], words: dict[int, tuple]) -> None:
        """Each word of row ``r``: (margin, start, end, label id, prob) kept where its margin is largest."""
        word_ids = enc.word_ids(r)
        offsets = enc["offset_mapping"][r]
        real = [k for k, w in enumerate(word_ids) if w is not None]
        if not real:
            return
        lo, hi = real[0], real[-1]
        row: dict[int, list[Any]] = {}
        for k in real:
            w = word_ids[k]
            s, e = offsets[k]
            if w not in row:
                row[w] = [min(k - lo, hi - k), s, e, pred[k][0], pred[k][1]]
            else:
                row[w][1], row[w][2] = min(row[w][1], s), max(row[w][2], e)
        for w, v in row.items():
            if w not in words or v[0] > words[w][0]:
                words[w] = tuple(v)

    def _entities(self, text: str, words: dict[int, tuple]) -> list[Span]:
        spans: list[Span] = []
        cur: list[Any] | None = None  # [start, end, type, probs, last word]

        def close() -> None:
            if cur is not None:
                score = sum(cur[3]) / len(cur[3])
                if score >= self.s.min_score and (not self.keep or cur[2] in self.keep) and cur[1] > cur[0]:
                    spans.append(make_span(text, cur[0], cur[1], cur[2], score))

        for w in sorted(words):
            _m, s, e, lab, p = words[w]
            tag, typ = split_label(self.labels.get(lab, "O"))
            if tag == "O":
                close()
                cur = None
            elif tag == "I" and cur is not None and cur[2] == typ and cur[4] == w - 1:
                cur[1], cur[4] = e, w
                cur[3].append(p)
            else:
                close()
                cur = [s, e, typ, [p], w]
        close()
        return spans
