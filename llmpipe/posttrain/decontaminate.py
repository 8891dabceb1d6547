"""Decontamination: drop instruction / preference records that share an n-gram with an evaluation item.

A model tuned on a copy of a test item scores that item from memory; the evaluate stage's built-in
tasks (``llmpipe/data/evaluation/tasks``: tiny_mc, tiny_cloze, tiny_docs) would then measure recall,
not skill. The rule is the GPT-3 paper's: a record whose text (prompt, response, chosen, rejected)
contains any ``n``-token window of an evaluation item is dropped; an item shorter than ``n`` tokens
counts as one window of its own length when it has at least :data:`MIN_TOKENS` (a short cloze sentence
copied whole is still a copy; three common words are not). Tokens are lowercased words, and each
CJK character is a token of its own (no spaces there to split on). An item's text is its context with
its answer (the correct choice, the target) and a document's whole text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from llmpipe.posttrain.config import MIN_NGRAM as MIN_TOKENS
from llmpipe.posttrain.data import Pair, Preference

TASKS_DIR = Path(__file__).resolve().parent.parent / "data" / "evaluation" / "tasks"
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def item_texts(record: dict) -> list[str]:
    """The texts of one evaluation item (lm-evaluation-harness JSONL of the built-in tasks)."""
    if "text" in record:
        return [record["text"]]
    context = record.get("context", "")
    if "target" in record:
        return [context + record["target"]]
    if "choices" in record and "label" in record:
        return [context + record["choices"][record["label"]]]
    return [context] if context else []


def builtin_eval_texts(tasks_dir: Path = TASKS_DIR) -> list[str]:
    """Every item text of the built-in evaluation tasks."""
    out = []
    for f in sorted(tasks_dir.glob("*/*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out += item_texts(json.loads(line))
    return out


class Index:
    """The n-gram windows of the evaluation items, by window length (``n``, or an item's own when shorter)."""

    def __init__(self, texts: Iterable[str], n: int) -> None:
        self.n = n
        self.grams: dict[int, set[tuple[str, ...]]] = {}
        for text in texts:
            t = tokens(text)
            if len(t) < MIN_TOKENS:
                continue
            size = min(n, len(t))
            self.grams.setdefault(size, set()).update(tuple(t[i: i + size]) for i in range(len(t) - size + 1))

    def contaminated(self, text: str) -> bool:
        t = tokens(text)
        return any(tuple(t[i: i + size]) in grams for size, grams in self.grams.items()
                   for i in range(len(t) - size + 1))


def record_text(item: Pair | Preference) -> str:
    """All the text of an instruction pair or a preference record, one string."""
    parts = [c for _r, c in item.prompt]
    parts += [item.response] if isinstance(item, Pair) else [item.chosen, item.rejected]
    return "\n".join(parts)


def decontaminate(items: list, n: int, eval_texts: list[str] | None = None) -> tuple[list, int]:
    """(the records sharing no n-gram with an evaluation item, how many were dropped)."""
    index = Index(builtin_eval_texts() if eval_texts is None else eval_texts, n)
    kept = [x for x in items if not index.contaminated(record_text(x))]
    return kept, len(items) - len(kept)
