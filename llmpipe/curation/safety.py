"""Safety: a per-language sensitive-word blocklist filter and PII redaction with checksum validation.

Blocklists are plain word lists (``llmpipe/data/curation/blocklist/<lang>.txt``, plus user files per
language). Spaced scripts match whole words only (``ass`` does not hit ``class``); the scripts
written without spaces (``llmpipe.curation.text.UNSPACED_LANGS``) match as substrings. The list used is the document's ``lang``.

PII is redacted in place with placeholders (``<EMAIL>``, ``<PHONE>``, ``<IP>``, ``<CREDIT_CARD>``,
``<CN_ID>``); counts per type go to ``doc.metadata["pii"]``. Number-like candidates are validated
before redaction (Luhn for cards, the GB 11643 ISO 7064 MOD 11-2 check digit and a real birth date
for Chinese resident IDs, ``ipaddress`` for IPs), so order numbers and versions are left alone.
Redaction runs longest-first (emails, IDs, cards, IPs, phones) so a card is never half-eaten as a phone.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import re
from collections import Counter
from collections.abc import Callable

from llmpipe.curation.config import BlocklistSettings, PiiSettings, SafetyConfig
from llmpipe.curation.entities.spans import ENTITIES, shift, spans_of
from llmpipe.curation.filters import Filter, FilterResult
from llmpipe.curation.text import UNSPACED_LANGS, read_word_list, shipped_languages, shipped_list
from llmpipe.document import Document

# -- blocklist ----------------------------------------------------------------------------------


def compile_blocklist(words: list[str], lang: str) -> re.Pattern[str] | None:
    """One regex for a language's list: word-bounded for spaced scripts, substring for the scripts written
    without spaces (``UNSPACED_LANGS``: CJK, Thai, Lao, Khmer, Burmese)."""
    words = sorted({w.lower() for w in words if w.strip()}, key=len, reverse=True)
    if not words:
        return None
    alt = "|".join(re.escape(w) for w in words)
    if lang.split("_")[0] in UNSPACED_LANGS:
        return re.compile(alt)
    return re.compile(rf"(?<!\w)(?:{alt})(?!\w)")


class BlocklistFilter(Filter):
    """Drops documents with more than ``max_hits`` blocklisted terms of their language (reason ``blocklist``)."""

    name = "blocklist"

    def __init__(self, settings: BlocklistSettings | None = None) -> None:
        self.s = settings or BlocklistSettings()
        langs = self.s.languages if self.s.languages is not None else shipped_languages("blocklist")
        words: dict[str, list[str]] = {}
        for lang in langs:
            p = shipped_list("blocklist", lang)
            if p is None:
                raise ValueError(f"safety.blocklist.languages: no shipped list for {lang!r} "
                                 f"(shipped: {shipped_languages('blocklist')}); give a file in blocklist.paths")
            words.setdefault(lang, []).extend(read_word_list(p))
        for lang, path in self.s.paths.items():
            words.setdefault(lang, []).extend(read_word_list(path))
        self.patterns = {lang: compile_blocklist(ws, lang) for lang, ws in words.items()}

    def filter(self, doc: Document) -> FilterResult:
        lang = doc.metadata.get("lang")
        if not isinstance(lang, str) or lang in ("und", "code", ""):
            lang = self.s.default_lang
        pat = self.patterns.get(lang)
        if pat is None:
            self.set_scores(doc, {"lang": lang, "checked": False, "hits": 0})
            return True
        hits = pat.findall(doc.text.lower())
        terms = sorted(set(hits))[:5]
        self.set_scores(doc, {"lang": lang, "checked": True, "hits": len(hits), "terms": terms})
        return (False, "blocklist") if len(hits) > self.s.max_hits else True


# -- PII ------------------------------------------------------------------------------------------
_CN_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_ID_CHECK = "10X98765432"


def luhn_valid(digits: str) -> bool:
    """The Luhn (mod 10) check used by every payment card number."""
    if not digits.isdigit():
        return False
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def cn_id_valid(s: str) -> bool:
    """An 18-character PRC resident ID: a real birth date and the ISO 7064 MOD 11-2 check character."""
    if len(s) != 18 or not s[:17].isdigit():
        return False
    try:
        born = _dt.date(int(s[6:10]), int(s[10:12]), int(s[12:14]))
    except ValueError:
        return False
    if not (_dt.date(1900, 1, 1) <= born <= _dt.date.today()):
        return False
    check = _CN_ID_CHECK[sum(int(c) * w for c, w in zip(s[:17], _CN_ID_WEIGHTS, strict=True)) % 11]
    return s[17].upper() == check


def _card_valid(m: str) -> bool:
    digits = re.sub(r"[ -]", "", m)
    return 13 <= len(digits) <= 19 and len(set(digits)) > 1 and luhn_valid(digits)


def _ipv6_valid(m: str) -> bool:
    if sum(1 for g in m.split(":") if g) < 2:
        return False
    try:
        ipaddress.IPv6Address(m)
    except ValueError:
        return False
    return True


def _phone_valid(m: str) -> bool:
    n = sum(c.isdigit() for c in m)
    return 7 <= n <= 15


_EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,24}(?![\w-])")
_CN_ID = re.compile(r"(?<![0-9A-Za-z])[1-9]\d{16}[0-9Xx](?![0-9A-Za-z])")
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
_IPV4 = re.compile(
    r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\d|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}"  # international
    r"|\(\d{3}\)[ ]?\d{3}[ .-]\d{4}|\d{3}[.-]\d{3}[.-]\d{4}"  # North American
    r"|1[3-9]\d[ -]?\d{4}[ -]?\d{4}"  # Chinese mobile
    r"|0\d{2,3}-\d{7,8}"  # Chinese landline with area code
    r")(?!\w)")

# (type, pattern, validator, placeholder): applied in this order.
PII_RULES: list[tuple[str, re.Pattern[str], Callable[[str], bool], str]] = [
    ("email", _EMAIL, lambda m: True, "<EMAIL>"),
    ("cn_id", _CN_ID, cn_id_valid, "<CN_ID>"),
    ("credit_card", _CARD, _card_valid, "<CREDIT_CARD>"),
    ("ip", _IPV4, lambda m: True, "<IP>"),
    ("ip", _IPV6, _ipv6_valid, "<IP>"),
    ("phone", _PHONE, _phone_valid, "<PHONE>"),
]


def redact_pii(text: str, types: set[str] | None = None) -> tuple[str, dict[str, int]]:
    """Replace valid PII with placeholders; returns the new text and counts per type."""
    counts: Counter[str] = Counter()
    for kind, pattern, valid, placeholder in PII_RULES:
        if types is not None and kind not in types:
            continue

        def sub(m: re.Match[str], kind: str = kind, valid: Callable[[str], bool] = valid,
                placeholder: str = placeholder) -> str:
            if valid(m.group(0)):
                counts[kind] += 1
                return placeholder
            return m.group(0)

        text = pattern.sub(sub, text)
    return text, dict(counts)


class PiiRedactor(Filter):
    """Keeps every document; redacts PII in its text and records ``metadata["pii"]`` counts."""

    name = "pii"

    def __init__(self, settings: PiiSettings | None = None) -> None:
        self.s = settings or PiiSettings()
        self.types = set(self.s.types)

    def filter(self, doc: Document) -> FilterResult:
        doc.text, counts = redact_pii(doc.text, self.types)
        if counts:
            doc.metadata["pii"] = counts
            for kind, n in counts.items():
                self.stat_update(kind, n)  # redactions per type, summed into the stage's funnel
        return True


def build_safety_filters(cfg: SafetyConfig) -> list[Filter]:
    make: dict[str, Callable[[], Filter]] = {
        "blocklist": lambda: BlocklistFilter(cfg.blocklist),
        "pii": lambda: PiiRedactor(cfg.pii),
    }
    return [make[name]() for name in cfg.filters]


# -- entity-based PII (the entities stage's ``redact`` labels) ------------------------------------


def redact_spans(text: str, spans: list[dict], labels: set[str]) -> tuple[str, list[dict], dict[str, int]]:
    """Replace the spans whose label is in ``labels`` by ``<LABEL>``, as e-mails become ``<EMAIL>``.

    Returns the new text, the other spans shifted to their new offsets, and redactions per label.
    """
    edits = [(sp["start"], sp["end"], f"<{sp['label']}>") for sp in spans if sp["label"] in labels]
    if not edits:
        return text, spans, {}
    counts = Counter(sp["label"] for sp in spans if sp["label"] in labels)
    kept = shift([sp for sp in spans if sp["label"] not in labels], edits)
    parts, pos = [], 0
    for s, e, new in edits:
        parts.append(text[pos:s])
        parts.append(new)
        pos = e
    parts.append(text[pos:])
    return "".join(parts), kept, dict(counts)


class EntityRedactor(Filter):
    """Keeps every document; redacts entity spans of the given labels (person names found by NER).

    Runs in the entities stage after the recognizers; counts go to ``metadata["pii"]`` beside
    safety's own (``{"PER": 2}``) and to the funnel's ``stats["pii"]`` per label.
    """

    name = "pii"

    def __init__(self, labels: list[str]) -> None:
        self.labels = set(labels)

    def filter(self, doc: Document) -> FilterResult:
        doc.text, kept, counts = redact_spans(doc.text, spans_of(doc.metadata), self.labels)
        if counts:
            doc.metadata[ENTITIES] = kept
            pii = doc.metadata.setdefault("pii", {})
            for label, n in sorted(counts.items()):
                pii[label] = pii.get(label, 0) + n
                self.stat_update(label, n)
        return True
