"""Entity spans: the one record every stage reads and writes, and the helpers that keep it exact.

A span is a dict ``{"start", "end", "label", "text", "score"}`` in ``doc.metadata["entities"]``,
character offsets into ``doc.text`` with ``text == doc.text[start:end]`` always (:func:`check_spans`).
Spans of one document never overlap and are sorted by ``start``.

Augmentation keeps spans whole by *protecting* them (:func:`protect`): each span is replaced by one
private-use character that no word, sentence or clause pattern matches, the operator edits the
protected text, and :func:`restore` puts the span texts back and records where each landed. An
operator therefore can neither replace part of an entity nor split a sentence inside one ("U.S.",
"March 5, 2024"), and the child's spans are shifted exactly.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

ENTITIES = "entities"  # the metadata key
Span = dict[str, Any]

# Supplementary Private Use Area-A: one character per protected span (65,534 of them).
_PUA_BASE = 0xF0000
_PUA_SIZE = 0xFFFE


def make_span(text: str, start: int, end: int, label: str, score: float = 1.0) -> Span:
    """A span of ``text`` (its ``text`` field is the slice, so it is exact by construction)."""
    return {"start": start, "end": end, "label": label, "text": text[start:end], "score": round(float(score), 4)}


def resolve_overlaps(candidates: Iterable[tuple[int, int, str, float, int]], text: str) -> list[Span]:
    """Non-overlapping spans from candidates ``(start, end, label, score, priority)``: leftmost-longest,
    ties broken by the lower priority number (the recognizer listed first). Empty candidates drop."""
    out: list[Span] = []
    last = 0
    for s, e, label, score, _prio in sorted(candidates, key=lambda c: (c[0], -(c[1] - c[0]), c[4])):
        if e > s and s >= last:
            out.append(make_span(text, s, e, label, score))
            last = e
    return out


def check_spans(text: str, spans: Sequence[Span], where: str = "") -> None:
    """Raise when a span is not exactly its slice of ``text``, out of order, or overlapping."""
    last = 0
    for sp in spans:
        s, e = sp["start"], sp["end"]
        if not (0 <= s < e <= len(text)) or s < last:
            raise ValueError(f"{where}: span {sp} out of range, order or overlapping (text length {len(text)})")
        if text[s:e] != sp["text"]:
            raise ValueError(f"{where}: span {sp} does not match the text there: {text[s:e]!r}")
        last = e


def spans_of(meta: dict[str, Any]) -> list[Span]:
    """The document's spans (a list, possibly empty)."""
    value = meta.get(ENTITIES)
    return list(value) if isinstance(value, list) else []


def overlaps(spans: Sequence[Span], start: int, end: int) -> bool:
    """Whether ``[start, end)`` touches any span (spans sorted, non-overlapping)."""
    return any(sp["start"] < end and start < sp["end"] for sp in spans)


def shift(spans: Sequence[Span], edits: Sequence[tuple[int, int, str]]) -> list[Span]:
    """Spans after non-overlapping ``(start, end, new)`` edits that touch no span (shifted by the edits before)."""
    out: list[Span] = []
    edits = sorted(edits)
    delta = j = 0
    for sp in spans:
        while j < len(edits) and edits[j][1] <= sp["start"]:
            s, e, new = edits[j]
            delta += len(new) - (e - s)
            j += 1
        if j < len(edits) and edits[j][0] < sp["end"]:
            raise ValueError(f"edit {edits[j][:2]} overlaps span {sp}")
        out.append({**sp, "start": sp["start"] + delta, "end": sp["end"] + delta})
    return out


def has_private_use(text: str) -> bool:
    """Whether ``text`` already holds characters :func:`protect` would use (then it cannot protect)."""
    return any(_PUA_BASE <= ord(c) < _PUA_BASE + _PUA_SIZE for c in text)


def protect(text: str, spans: Sequence[Span]) -> str:
    """``text`` with span ``i`` replaced by the private-use character ``U+F0000 + i``."""
    if len(spans) > _PUA_SIZE:
        raise ValueError(f"cannot protect {len(spans)} spans (at most {_PUA_SIZE})")
    parts, pos = [], 0
    for i, sp in enumerate(spans):
        parts.append(text[pos : sp["start"]])
        parts.append(chr(_PUA_BASE + i))
        pos = sp["end"]
    parts.append(text[pos:])
    return "".join(parts)


def restore(protected: str, spans: Sequence[Span]) -> tuple[str, list[Span]] | None:
    """The text with each protection character replaced by its span's text, and the spans at their new
    offsets (in text order); None when an operator lost or duplicated a span (the child is skipped)."""
    seen: set[int] = set()
    parts: list[str] = []
    new: list[Span] = []
    pos = length = 0
    for k, c in enumerate(protected):
        i = ord(c) - _PUA_BASE
        if not 0 <= i < len(spans):
            continue
        if i in seen:
            return None
        seen.add(i)
        chunk = protected[pos:k]
        parts.append(chunk)
        length += len(chunk)
        sp = spans[i]
        new.append({**sp, "start": length, "end": length + len(sp["text"])})
        parts.append(sp["text"])
        length += len(sp["text"])
        pos = k + 1
    if len(seen) != len(spans):
        return None
    parts.append(protected[pos:])
    return "".join(parts), new


def nfkc_map(text: str) -> tuple[str, list[int] | None]:
    """(NFKC form of ``text`` for matching, index map normalized -> original character; None = identity).

    Characters are normalized one by one, so every normalized character comes from exactly one
    original character and a match maps back to an exact slice of the original text.
    """
    if text.isascii() or unicodedata.is_normalized("NFKC", text):
        return text, None
    parts: list[str] = []
    index: list[int] = []
    for i, c in enumerate(text):
        n = unicodedata.normalize("NFKC", c) if ord(c) > 127 else c
        parts.append(n)
        index.extend([i] * len(n))
    return "".join(parts), index


def to_original(index: list[int] | None, start: int, end: int) -> tuple[int, int]:
    """Offsets of a match ``[start, end)`` in the normalized text, back in the original text."""
    if index is None:
        return start, end
    return index[start], index[end - 1] + 1
