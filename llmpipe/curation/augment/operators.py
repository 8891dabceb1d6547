"""Text augmentation operators that need no model: synonyms, restructuring, templates.

Every operator works on a batch of ``(Document, random.Random)`` pairs and returns one
:class:`Outcome` per document: the new texts, or the reason nothing was produced. The random
generator is seeded from (augment seed, operator label, document id), so a document's augmentation
does not depend on which other documents share its shard or batch: the output is deterministic for a
seed and stable when a refresh adds shards.

Entity spans (``metadata["entities"]``, from the ``entities`` stage) are never replaced or broken:
synonym replacement skips words inside a span; restructuring works on the text with every span
protected as one character (:func:`llmpipe.curation.entities.spans.protect`), so a span moves whole
and no sentence or clause is split inside one; templates can fill slots with the document's own
entities by label. Each outcome carries the child's spans at their new offsets. A document without
spans is augmented exactly as before.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from llmpipe.curation.augment.config import HEURISTIC_SLOTS, RestructureOp, SynonymOp, TemplateOp
from llmpipe.curation.entities.spans import ENTITIES, Span, has_private_use, protect, restore, shift, spans_of
from llmpipe.document import Document

# Languages written without spaces between words: matched by longest dictionary entry, per character.
CJK_LANGS = frozenset({"zh", "ja", "yue", "wuu", "lzh"})
_WORD = re.compile(r"[^\W\d_]+")
_CJK_CHAR = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_SLOT = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_PARA_SPLIT = re.compile(r"(\n\s*\n)")
_SENT_END = re.compile(r"(?<=[.!?])[\"'”’)\]]*\s+|(?<=[。！？])[”’」』）]*\s*")
_CLAUSE_SPLIT = re.compile(r",\s+|，|;\s+|；")
_TERMINAL = re.compile(r"[.!?。！？…]+[\"'”’)\]」』）]*$")
_CAPITALIZED = re.compile(r"\b[A-Z][a-zA-Z]+(?:\s+[A-Z][a-zA-Z]+)*\b")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_COMMON_CAPS = frozenset({"The", "A", "An", "In", "On", "At", "It", "This", "That", "These", "Those", "I", "We",
                          "He", "She", "They", "You", "But", "And", "Or", "If", "When", "As", "For", "To"})


@dataclass
class Outcome:
    """What an operator made of one document: new texts, or why it made none.

    ``spans``: each text's entity spans when the document has spans (None: the operator left that to
    :func:`relocate`, or the document has none).
    """

    texts: list[str] = field(default_factory=list)
    reason: str | None = None
    spans: list[list[Span]] | None = None


def relocate(text: str, spans: list[Span]) -> list[Span]:
    """The spans whose text is still in ``text``, found in order (for operators that rewrite freely,
    such as back-translation); a span whose text is gone is dropped."""
    out, pos = [], 0
    for sp in spans:
        at = text.find(sp["text"], pos)
        if at >= 0:
            out.append({**sp, "start": at, "end": at + len(sp["text"])})
            pos = at + len(sp["text"])
    return out


def lang_of(doc: Document) -> str:
    """The document's language code without region/script (``zh-Hans`` -> ``zh``); ``und`` if unknown."""
    lang = str(doc.metadata.get("lang") or "und")
    return lang.replace("_", "-").split("-")[0].lower()


def data_path(name: str) -> Path:
    """A file shipped in ``llmpipe/data/augment``."""
    return Path(str(resources.files("llmpipe").joinpath("data", "augment", name)))


# -- synonym replacement --------------------------------------------------------------------------

def load_synonym_table(path: str | Path) -> dict[str, list[str]]:
    """Read ``word<TAB>synonym<TAB>...`` lines ('#' comments, blank lines skipped); duplicates merge."""
    table: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.rstrip("\n").rstrip("\r")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = [p.strip() for p in line.split("\t")]
            if len(parts) < 2 or not all(parts):
                raise ValueError(f"{path}:{lineno}: expected 'word<TAB>synonym[<TAB>synonym...]', got {line!r}")
            key = parts[0].lower()
            syns = table.setdefault(key, [])
            syns.extend(s for s in parts[1:] if s.lower() != key and s not in syns)
    return table


class SynonymReplacer:
    """Replace words by table synonyms with ``probability`` each (at least one when any matches)."""

    def __init__(self, op: SynonymOp) -> None:
        self.op = op
        paths = op.tables or {"en": [str(data_path("synonyms_en.tsv"))],
                              "zh": [str(data_path("synonyms_zh.tsv"))]}
        self.tables: dict[str, dict[str, list[str]]] = {}
        for lang, files in paths.items():
            merged: dict[str, list[str]] = {}
            for p in files:
                for k, v in load_synonym_table(p).items():
                    merged.setdefault(k, []).extend(s for s in v if s not in merged.get(k, []))
            self.tables[lang.lower()] = {k: v for k, v in merged.items() if v}
        self.max_len = {lang: max((len(k) for k in t), default=1) for lang, t in self.tables.items()}

    def apply(self, batch: Sequence[tuple[Document, random.Random]]) -> list[Outcome]:
        return [self._one(doc, rng) for doc, rng in batch]

    def _one(self, doc: Document, rng: random.Random) -> Outcome:
        lang = lang_of(doc)
        table = self.tables.get(lang)
        if table is None:
            return Outcome(reason="no_table_for_language")
        ents = spans_of(doc.metadata)
        spans = self._matches(doc.text, table, lang)
        if ents:  # never replace a word inside an entity
            spans = [m for m in spans if not _touches(ents, m[0], m[1])]
        if not spans:
            return Outcome(reason="no_match")
        chosen = [s for s in spans if rng.random() < self.op.probability] or [rng.choice(spans)]
        chosen = chosen[: self.op.max_replacements]
        edits = [(s, e, _match_case(w, rng.choice(table[w.lower()]))) for s, e, w in chosen]
        text = apply_edits(doc.text, edits)
        return Outcome(texts=[text], spans=[shift(ents, edits)] if ENTITIES in doc.metadata else None)

    def _matches(self, text: str, table: dict[str, list[str]], lang: str) -> list[tuple[int, int, str]]:
        if lang in CJK_LANGS:
            return _longest_matches(text, table, self.max_len[lang])
        return [(m.start(), m.end(), m.group()) for m in _WORD.finditer(text) if m.group().lower() in table]


def _longest_matches(text: str, table: dict[str, list[str]], max_len: int) -> list[tuple[int, int, str]]:
    """Forward maximum matching: at each position take the longest table entry that starts there."""
    out, i, n = [], 0, len(text)
    while i < n:
        for size in range(min(max_len, n - i), 0, -1):
            piece = text[i : i + size]
            if piece.lower() in table:
                out.append((i, i + size, piece))
                i += size
                break
        else:
            i += 1
    return out


def _touches(spans: list[Span], start: int, end: int) -> bool:
    return any(sp["start"] < end and start < sp["end"] for sp in spans)


def _match_case(original: str, replacement: str) -> str:
    if len(original) > 1 and original.isupper():
        return replacement.upper()
    if original[:1].isupper():
        return replacement[:1].upper() + replacement[1:]
    return replacement


def apply_edits(text: str, edits: Iterable[tuple[int, int, str]]) -> str:
    """Replace non-overlapping ``(start, end, new)`` spans of ``text``."""
    parts, pos = [], 0
    for s, e, new in sorted(edits):
        parts.append(text[pos:s])
        parts.append(new)
        pos = e
    parts.append(text[pos:])
    return "".join(parts)


# -- sentence restructuring -----------------------------------------------------------------------

def split_sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph by end punctuation (Latin and CJK), whitespace stripped."""
    pieces, pos = [], 0
    for m in _SENT_END.finditer(paragraph):
        pieces.append(paragraph[pos : m.end()])
        pos = m.end()
    pieces.append(paragraph[pos:])
    return [p.strip() for p in pieces if p.strip()]


class Restructurer:
    """Reorder the sentences (or a sentence's clauses) of randomly chosen paragraphs."""

    def __init__(self, op: RestructureOp, log: object | None = None) -> None:
        self.op = op
        self.nlp = _load_spacy(op.parser, log) if op.parser else None

    def apply(self, batch: Sequence[tuple[Document, random.Random]]) -> list[Outcome]:
        return [self._one(doc, rng) for doc, rng in batch]

    def _sentences(self, paragraph: str) -> list[str]:
        if self.nlp is not None:
            return [s.text.strip() for s in self.nlp(paragraph).sents if s.text.strip()]
        return split_sentences(paragraph)

    def _one(self, doc: Document, rng: random.Random) -> Outcome:
        ents = spans_of(doc.metadata)
        if not ents:
            out = self._reordered(doc.text, lang_of(doc), rng)
            if out.texts and ENTITIES in doc.metadata:
                out.spans = [[]]
            return out
        if has_private_use(doc.text):
            return Outcome(reason="private_use_characters")
        out = self._reordered(protect(doc.text, ents), lang_of(doc), rng)
        if not out.texts:
            return out
        restored = restore(out.texts[0], ents)
        if restored is None:
            return Outcome(reason="entity_lost")
        return Outcome(texts=[restored[0]], spans=[restored[1]])

    def _reordered(self, text: str, lang: str, rng: random.Random) -> Outcome:
        joiner = "" if lang in CJK_LANGS else " "
        parts = _PARA_SPLIT.split(text)  # paragraphs at even indices, separators at odd ones
        candidates: list[tuple[int, list[str]]] = []
        for i in range(0, len(parts), 2):
            units = self._units(parts[i])
            if (self.op.unit == "clause" and units) or len(set(units)) >= 2:
                candidates.append((i, units))
        if not candidates:
            return Outcome(reason=f"no_multi_{self.op.unit}_paragraph")
        chosen = [c for c in candidates if rng.random() < self.op.probability] or [rng.choice(candidates)]
        for i, units in chosen:
            lead = parts[i][: len(parts[i]) - len(parts[i].lstrip())]
            trail = parts[i][len(parts[i].rstrip()):]
            parts[i] = lead + self._reorder(units, rng, joiner) + trail
        return Outcome(texts=["".join(parts)])

    def _units(self, paragraph: str) -> list[str]:
        sents = self._sentences(paragraph)
        if self.op.unit == "clause":
            return sents if any(len(_CLAUSE_SPLIT.split(x)) >= 2 for x in sents) else []
        return sents

    def _reorder(self, units: list[str], rng: random.Random, joiner: str) -> str:
        if self.op.unit == "clause":
            multi = [i for i, x in enumerate(units) if len(_CLAUSE_SPLIT.split(x)) >= 2]
            chosen = [i for i in multi if rng.random() < self.op.probability] or [rng.choice(multi)]
            return joiner.join(_reorder_clauses(x, rng) if i in chosen else x for i, x in enumerate(units))
        order = _derangement_like(len(units), rng, units)
        return joiner.join(units[j] for j in order)


def _derangement_like(n: int, rng: random.Random, units: list[str]) -> list[int]:
    """A shuffled order that differs from the original text (rotates when the shuffle changed nothing)."""
    order = list(range(n))
    rng.shuffle(order)
    if [units[j] for j in order] == units:
        order = order[1:] + order[:1]
    return order


def _reorder_clauses(sentence: str, rng: random.Random) -> str:
    m = _TERMINAL.search(sentence)
    terminal = m.group() if m else ""
    body = sentence[: len(sentence) - len(terminal)]
    cjk = "，" in body or "；" in body
    clauses = [c.strip() for c in _CLAUSE_SPLIT.split(body) if c.strip()]
    if len(clauses) < 2:
        return sentence
    order = _derangement_like(len(clauses), rng, clauses)
    new = [clauses[j] for j in order]
    if not cjk:
        first_old = clauses[0]
        first_word = first_old.split(" ", 1)[0]
        lower_ok = first_word in _COMMON_CAPS and first_word != "I"  # never lower-case a name
        new = [_decapitalize(c) if c is first_old and lower_ok else c for c in new]
        new[0] = new[0][:1].upper() + new[0][1:]
    return ("，" if cjk else ", ").join(new) + terminal


def _decapitalize(s: str) -> str:
    return s[:1].lower() + s[1:]


def _load_spacy(name: str, log: object | None) -> object | None:
    """A spaCy pipeline where spaCy and the model are installed; otherwise None (regex sentences)."""
    try:
        import spacy  # optional: not a dependency of llmpipe
    except ImportError:
        _warn(log, f"augment restructure: parser {name!r} requested but spaCy is not installed; "
                   "using punctuation-based sentence splitting")
        return None
    try:
        return spacy.load(name)
    except OSError as e:
        _warn(log, f"augment restructure: cannot load spaCy pipeline {name!r} ({e}); using punctuation")
        return None


def _warn(log: object | None, msg: str) -> None:
    if log is not None and hasattr(log, "warning"):
        log.warning(msg)


# -- template filling -----------------------------------------------------------------------------

def load_templates(path: str | Path) -> dict[str, list[str]]:
    """Templates by language from a file with ``[lang]`` section lines (``[*]`` or none: any language)."""
    out: dict[str, list[str]] = {}
    lang = "*"
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("[") and line.endswith("]"):
                lang = line[1:-1].strip().lower() or "*"
                continue
            if "{" in line and not _SLOT.search(line):
                raise ValueError(f"{path}:{lineno}: malformed slot in template {line!r} (use {{NAME}})")
            out.setdefault(lang, []).append(line)
    return out


def find_entities(text: str) -> dict[str, list[str]]:
    """Candidate slot values found in a text: capitalized names (not sentence-initial words) and numbers."""
    caps = []
    for m in _CAPITALIZED.finditer(text):
        word = m.group()
        if word in _COMMON_CAPS:
            continue
        before = text[: m.start()].rstrip()
        if not before or before[-1] in ".!?\n":  # sentence-initial capital: not evidence of a name
            word = " ".join(word.split()[1:])
        if word and word not in _COMMON_CAPS:
            caps.append(word)
    return {"capitalized": sorted(set(caps)), "number": sorted(set(_NUMBER.findall(text)))}


# labels of the rule recognizer that are numbers: a "number" slot takes them, a "capitalized" slot the rest
_NUMBER_LABELS = frozenset({"QUANTITY", "MONEY", "PERCENT", "CARDINAL"})
_NOT_NAMES = _NUMBER_LABELS | {"DATE", "TIME", "URL", "EMAIL", "ORDINAL"}


def _entity_values(spans: list[Span]) -> tuple[dict[str, list[str]], dict[tuple[str, str], Span]]:
    """The document's entity texts by label and by heuristic kind (``capitalized``: names of any label,
    ``number``: quantities, money, percentages), each text once; and the first span of each."""
    by: dict[str, list[str]] = {}
    first: dict[tuple[str, str], Span] = {}
    for sp in spans:
        kinds = [sp["label"]]
        if sp["label"] in _NUMBER_LABELS:
            kinds.append("number")
        elif sp["label"] not in _NOT_NAMES:
            kinds.append("capitalized")
        for kind in kinds:
            if (kind, sp["text"]) not in first:
                first[(kind, sp["text"])] = sp
                by.setdefault(kind, []).append(sp["text"])
    return by, first


class TemplateFiller:
    """Make new documents by filling templates with the document's (or its shard's) entities."""

    def __init__(self, op: TemplateOp) -> None:
        self.op = op
        self.templates: dict[str, list[str]] = {}
        if op.templates_file is not None or not op.templates:
            self.templates = load_templates(op.templates_file or data_path("templates.txt"))
        if op.templates:
            self.templates.setdefault("*", []).extend(op.templates)
        known = set(op.values) | set(op.entity_slots)  # entity_slots: a heuristic kind or an entity label
        for lang, temps in self.templates.items():
            for t in temps:
                unknown = set(_SLOT.findall(t)) - known
                if unknown:
                    raise ValueError(f"augment template ({lang}) {t!r}: slots {sorted(unknown)} are neither in "
                                     f"values nor in entity_slots")
        self.pool: dict[str, list[str]] = {"capitalized": [], "number": []}

    def prepare(self, docs: Sequence[Document]) -> None:
        """Collect the shard's entities: the fallback when a document lacks one a template needs."""
        pool: dict[str, set[str]] = {"capitalized": set(), "number": set()}
        for d in docs:
            for kind, vals in find_entities(d.text).items():
                pool[kind].update(vals)
        self.pool = {k: sorted(v) for k, v in pool.items()}

    def apply(self, batch: Sequence[tuple[Document, random.Random]]) -> list[Outcome]:
        return [self._one(doc, rng) for doc, rng in batch]

    def _one(self, doc: Document, rng: random.Random) -> Outcome:
        lang = lang_of(doc)
        own = find_entities(doc.text)
        by_label, first = _entity_values(spans_of(doc.metadata))
        temps = self.templates.get(lang, []) + self.templates.get("*", [])
        usable = [t for t in temps if all(self._values(s, own, by_label) for s in _SLOT.findall(t))]
        if not usable:
            return Outcome(reason="no_fillable_template")
        texts, spans = [], []
        for _ in range(self.op.per_document):
            t = rng.choice(usable)
            parts: list[str] = []
            child: list[Span] = []
            pos = size = 0
            for m in _SLOT.finditer(t):
                parts.append(t[pos : m.start()])
                size += m.start() - pos
                slot = m.group(1)
                value = rng.choice(self._values(slot, own, by_label))
                parent = first.get((self.op.entity_slots.get(slot, ""), value)) if slot not in self.op.values else None
                if parent is not None:  # an entity of the parent, at its place in the child
                    child.append({**parent, "start": size, "end": size + len(value)})
                parts.append(value)
                size += len(value)
                pos = m.end()
            parts.append(t[pos:])
            texts.append("".join(parts))
            spans.append(child)
        return Outcome(texts=texts, spans=spans if ENTITIES in doc.metadata else None)

    def _values(self, slot: str, own: dict[str, list[str]], by_label: dict[str, list[str]]) -> list[str]:
        if slot in self.op.values:
            return self.op.values[slot]
        kind = self.op.entity_slots[slot]
        if kind not in HEURISTIC_SLOTS:
            return by_label.get(kind, [])
        return by_label.get(kind) or own.get(kind) or self.pool.get(kind, [])
