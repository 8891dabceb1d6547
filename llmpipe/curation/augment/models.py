"""Model-based augmentation: contextual replacement (masked LM) and back-translation (seq2seq chain).

Models are loaded by path with ``transformers`` Auto classes, once per worker process (a module-level
cache), and run without sampling: contextual replacement draws among the top-k predictions with the
document's seeded generator; back-translation decodes greedily or with beams. Both are therefore
deterministic for a seed on a given device.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmpipe.curation.augment.config import BackTranslationOp, ContextualOp
from llmpipe.curation.augment.operators import (
    _CJK_CHAR,
    _PARA_SPLIT,
    _WORD,
    CJK_LANGS,
    Outcome,
    apply_edits,
    lang_of,
    split_sentences,
)
from llmpipe.curation.entities.spans import ENTITIES, has_private_use, protect, restore, shift, spans_of
from llmpipe.document import Document

_MODELS: dict[tuple[str, str, str], tuple[Any, Any]] = {}


def check_model_dir(path: str, what: str) -> None:
    """Fail early, in the main process, with the config key and the path when a model is missing."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{what}: no model at {path!r} (expected a directory with config.json)")


def load_model(kind: str, path: str, device: str) -> tuple[Any, Any]:
    """(tokenizer, model) for ``kind`` in {"mlm", "seq2seq"}, cached per process."""
    key = (kind, str(Path(path).resolve()), device)
    if key not in _MODELS:
        from transformers import AutoModelForMaskedLM, AutoModelForSeq2SeqLM, AutoTokenizer

        cls = AutoModelForMaskedLM if kind == "mlm" else AutoModelForSeq2SeqLM
        tok = AutoTokenizer.from_pretrained(path)
        model = cls.from_pretrained(path).to(device).eval()
        _MODELS[key] = (tok, model)
    return _MODELS[key]


class ContextualReplacer:
    """Mask chosen words (characters for CJK) one at a time and put in a top-k prediction."""

    def __init__(self, op: ContextualOp, device: str = "cpu") -> None:
        self.op, self.device = op, device
        self.tok, self.model = load_model("mlm", op.model, device)
        if self.tok.mask_token is None:
            raise ValueError(f"augment contextual: tokenizer at {op.model!r} has no mask token")
        limit = getattr(self.tok, "model_max_length", 512) or 512
        self.max_len = int(min(limit, getattr(self.model.config, "max_position_embeddings", 512), 512))

    def apply(self, batch: Sequence[tuple[Document, random.Random]]) -> list[Outcome]:
        jobs: list[tuple[int, int, int, str, str]] = []  # (doc index, start, end, original, masked text)
        for di, (doc, rng) in enumerate(batch):
            for s, e, w in self._choose(doc, rng):
                w0, w1 = max(0, s - self.op.window_chars), e + self.op.window_chars
                jobs.append((di, s, e, w, doc.text[w0:s] + self.tok.mask_token + doc.text[e:w1]))
        candidates = self._predict([j[4] for j in jobs])
        edits: list[list[tuple[int, int, str]]] = [[] for _ in batch]
        for (di, s, e, w, _), cands in zip(jobs, candidates, strict=True):
            good = [c for c in cands if c.lower() != w.lower() and _same_kind(c, w)][: self.op.top_k]
            if good:
                edits[di].append((s, e, batch[di][1].choice(good)))
        out = []
        for (doc, _), ed in zip(batch, edits, strict=True):
            if not ed:
                out.append(Outcome(reason="no_prediction"))
                continue
            spans = [shift(spans_of(doc.metadata), ed)] if ENTITIES in doc.metadata else None
            out.append(Outcome(texts=[apply_edits(doc.text, ed)], spans=spans))
        return out

    def _choose(self, doc: Document, rng: random.Random) -> list[tuple[int, int, str]]:
        pat = _CJK_CHAR if lang_of(doc) in CJK_LANGS else _WORD
        ents = spans_of(doc.metadata)  # words inside an entity are never masked
        spans = [(m.start(), m.end(), m.group()) for m in pat.finditer(doc.text)
                 if (pat is _CJK_CHAR or len(m.group()) >= 3)
                 and not any(e["start"] < m.end() and m.start() < e["end"] for e in ents)]
        if not spans:
            return []
        chosen = [s for s in spans if rng.random() < self.op.probability] or [rng.choice(spans)]
        return chosen[: self.op.max_replacements]

    def _predict(self, texts: list[str]) -> list[list[str]]:
        import torch

        out: list[list[str]] = []
        k = self.op.top_k + 8  # room for predictions that are filtered out (the word itself, punctuation)
        for i in range(0, len(texts), self.op.batch_size):
            chunk = texts[i : i + self.op.batch_size]
            enc = self.tok(chunk, return_tensors="pt", padding=True, truncation=True, max_length=self.max_len)
            enc = {n: t.to(self.device) for n, t in enc.items()}
            with torch.no_grad():
                logits = self.model(**enc).logits
            for row in range(len(chunk)):
                pos = (enc["input_ids"][row] == self.tok.mask_token_id).nonzero()
                if len(pos) == 0:  # the mask was truncated away
                    out.append([])
                    continue
                top = logits[row, int(pos[0])].topk(min(k, logits.shape[-1])).indices.tolist()
                special = set(self.tok.all_special_ids)
                out.append([self.tok.decode([t]).strip() for t in top if t not in special])
        return out


def _same_kind(cand: str, word: str) -> bool:
    """A replacement must look like the word it replaces: letters for words, one CJK char for CJK."""
    if _CJK_CHAR.fullmatch(word):
        return bool(_CJK_CHAR.fullmatch(cand))
    return cand.isalpha()


class BackTranslator:
    """Paraphrase by translating sentences through a chain of seq2seq models (e.g. zh->en->zh).

    A sentence that holds an entity span is kept as it is (a translation would rewrite the name or
    the date): spans are protected as one character each, and sentences holding one are not sent to
    the models, so a child carries every span of its parent, exactly.
    """

    def __init__(self, op: BackTranslationOp, device: str = "cpu") -> None:
        self.op, self.device = op, device
        self.chain = [load_model("seq2seq", p, device) for p in op.chain]

    def apply(self, batch: Sequence[tuple[Document, random.Random]]) -> list[Outcome]:
        layouts, flat = [], []
        for doc, _ in batch:
            ents = spans_of(doc.metadata)
            guard = ents if ents and not has_private_use(doc.text) else []  # else: relocate() afterwards
            parts = _PARA_SPLIT.split(protect(doc.text, guard) if guard else doc.text)
            sents = [split_sentences(parts[i]) for i in range(0, len(parts), 2)]
            layouts.append((parts, sents, guard))
            n = 0
            for ss in sents:
                take = ss[: max(0, self.op.max_sentences - n)]
                flat.extend(x for x in take if not (guard and has_private_use(x)))
                n += len(take)
        translated = self.translate(flat)
        out, pos = [], 0
        for (doc, _), (parts, sents, guard) in zip(batch, layouts, strict=True):
            joiner = "" if lang_of(doc) in CJK_LANGS else " "
            n = 0
            for pi, ss in enumerate(sents):
                take = min(len(ss), max(0, self.op.max_sentences - n))
                new = []
                for x in ss[:take]:
                    if guard and has_private_use(x):  # holds a span: not translated
                        new.append(x)
                    else:
                        new.append(translated[pos].strip())
                        pos += 1
                new += ss[take:]
                n += take
                parts[2 * pi] = joiner.join(x for x in new if x)
            text = "".join(parts)
            spans = None
            if guard:
                restored = restore(text, guard)
                if restored is None:
                    out.append(Outcome(reason="entity_lost"))
                    continue
                text, spans = restored[0], [restored[1]]
            if not text.strip():
                out.append(Outcome(reason="empty_translation"))
            elif text == doc.text:
                out.append(Outcome(reason="unchanged"))
            else:
                out.append(Outcome(texts=[text], spans=spans))
        return out

    def translate(self, texts: list[str]) -> list[str]:
        """Run ``texts`` through every model of the chain, in batches, without sampling."""
        import torch

        for tok, model in self.chain:
            nxt: list[str] = []
            for i in range(0, len(texts), self.op.batch_size):
                chunk = texts[i : i + self.op.batch_size]
                enc = tok(chunk, return_tensors="pt", padding=True, truncation=True,
                          max_length=min(512, getattr(tok, "model_max_length", 512) or 512))
                enc = {n: t.to(self.device) for n, t in enc.items()}
                with torch.no_grad():
                    gen = model.generate(**enc, max_new_tokens=self.op.max_new_tokens,
                                         num_beams=self.op.num_beams, do_sample=False)
                nxt.extend(tok.batch_decode(gen, skip_special_tokens=True))
            texts = nxt
        return texts
