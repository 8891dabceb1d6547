"""The rule recognizer: dates, times, quantities, money, percentages, URLs, e-mails, and gazetteers.

Patterns run on the NFKC form of the text (full-width digits, ``℃``, ligatures match like their
plain forms) and every match maps back to an exact slice of the original text
(:func:`llmpipe.curation.entities.spans.nfkc_map`). Overlaps resolve leftmost-longest, so
"March 5, 2024" is one DATE, not a DATE and a number. A gazetteer is a TSV of ``surface<TAB>label``;
forms in Chinese or Japanese characters match anywhere (those scripts have no spaces), other forms
only on word boundaries (``Anna`` does not hit ``Annabelle``); the longest form wins.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from pathlib import Path

import regex

from llmpipe.curation.entities.config import RuleSettings
from llmpipe.curation.entities.spans import Span, nfkc_map, resolve_overlaps, to_original

_CJK = r"\p{Han}\p{Hiragana}\p{Katakana}ー々"
# a letter or digit of a spaced script: what a word boundary looks for (CJK characters are not one)
_WORDCH = rf"[^\W{_CJK}]"
_NUM = r"(?<![\d.,])\d+(?:[.,]\d+)*"
_SCALE = r"(?:million|billion|trillion|thousand|Mio\.?|Mrd\.?|Millionen|Milliarden|万|亿|億|千万|百万)"
_CURRENCY_PRE = r"(?:US\$|HK\$|[$€£¥₩₹]|(?:USD|EUR|GBP|CNY|RMB|JPY|CHF)\s?)"
_CURRENCY_POST = (r"(?:€|\$|USD|EUR|GBP|CNY|RMB|JPY|CHF|dollars?|euros?|Euro|pounds? sterling|yuan|yen|"
                  r"元|円|美元|欧元|日元|人民币|ドル|ユーロ)")
_MONTHS_EN = (r"(?:January|February|March|April|May|June|July|August|September|October|November|December|"
              r"Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept|Sep|Oct|Nov|Dec)")
_MONTHS_DE = r"(?:Januar|Jänner|Februar|März|Maerz|April|Mai|Juni|Juli|August|September|Oktober|November|Dezember)"
_UNITS = (r"(?:km/h|km²|m²|m³|km|cm|mm|µm|μm|nm|mg|kg|g|ml|mL|L|GB|MB|KB|kB|TB|GHz|MHz|Hz|kWh|kW|MW|W|V|mAh|"
          r"°C|°F|mph|miles?|feet|ft|inch(?:es)?|lbs?|Meter|Kilometer|Kilogramm|Gramm|Liter|"
          r"公里|千米|厘米|毫米|米|公斤|千克|克|吨|毫升|升|平方米|キロ|メートル|グラム|リットル)")
_END = rf"(?!{_WORDCH})"  # not followed by a letter/digit of a spaced script

PATTERNS: dict[str, tuple[str, str]] = {  # kind -> (label, pattern)
    "email": ("EMAIL", r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,24}"
                       r"(?![A-Za-z0-9-])"),
    "url": ("URL", rf"(?<![A-Za-z0-9/])(?:https?://|www\.)[^\s<>\"'{_CJK}，。、「」（）]+(?<![.,;:!?)\]}}'\"»])"),
    "money": ("MONEY", rf"{_CURRENCY_PRE}\d+(?:[.,]\d+)*(?:\s?{_SCALE})?{_END}"
                       rf"|{_NUM}\s?(?:{_SCALE}\s?)?{_CURRENCY_POST}{_END}"),
    "percent": ("PERCENT", rf"{_NUM}\s?(?:%|percent|per cent|Prozent|パーセント){_END}|百分之[\d零一二三四五六七八九十百]+"),
    "date": ("DATE", rf"(?<!\d)\d{{4}}-\d{{1,2}}-\d{{1,2}}(?!\d)|(?<!\d)\d{{4}}/\d{{1,2}}/\d{{1,2}}(?!\d)"
                     # 5.3.2024 (a four-digit year: "2.6.33" is a version), 03/05/24
                     rf"|(?<![\d.])(?:0?[1-9]|[12]\d|3[01])\.(?:0?[1-9]|1[0-2])\.\d{{4}}(?![\d.]\d)"
                     rf"|(?<![\d/])\d{{1,2}}/\d{{1,2}}/(?:\d{{4}}|\d{{2}})(?![\d/])"
                     rf"|(?<!\d)\d{{4}}年(?:\d{{1,2}}月(?:\d{{1,2}}[日号])?)?|(?<!\d)\d{{1,2}}月\d{{1,2}}[日号]"
                     rf"|(?<!{_WORDCH}){_MONTHS_EN}\.?\s\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s\d{{4}})?{_END}"
                     rf"|(?<![\d.])\d{{1,2}}(?:st|nd|rd|th)?\s(?:of\s)?{_MONTHS_EN}(?:,?\s\d{{4}})?{_END}"
                     rf"|(?<![\d.])\d{{1,2}}\.\s?{_MONTHS_DE}(?:\s\d{{4}})?{_END}"
                     rf"|(?<!{_WORDCH})(?:{_MONTHS_EN}|{_MONTHS_DE})\s\d{{4}}{_END}"),
    "time": ("TIME", rf"(?<![\d:])\d{{1,2}}:\d{{2}}(?::\d{{2}})?(?:\s?(?:[ap]\.m\.|[ap]m|Uhr))?(?![\d:]|{_WORDCH})"
                     rf"|(?<!\d)\d{{1,2}}\s?(?:[ap]\.m\.|[ap]m|Uhr){_END}"
                     rf"|(?:上午|下午|晚上|早上|中午|午前|午後)?(?<!\d)\d{{1,2}}[点時时](?:\d{{1,2}}分)?(?:\d{{1,2}}秒)?"),
    "quantity": ("QUANTITY", rf"{_NUM}\s?{_UNITS}{_END}"),
}
_PRIORITY = {kind: i for i, kind in enumerate(("email", "url", "money", "percent", "date", "time", "quantity"))}
_CJK_RE = regex.compile(rf"[{_CJK}]")


def load_gazetteer(path: str | Path) -> dict[str, str]:
    """``surface form<TAB>label`` lines ('#' comments and blank lines skipped); errors name file and line."""
    p = Path(path)
    out: dict[str, str] = {}
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: gazetteer not found (entities.rules.gazetteers)") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(f"{p}:{lineno}: expected 'surface form<TAB>label', got {line!r}")
        form = unicodedata.normalize("NFKC", parts[0].strip())
        label = parts[1].strip()
        if out.get(form, label) != label:
            raise ValueError(f"{p}:{lineno}: {form!r} is labelled both {out[form]!r} and {label!r}")
        out[form] = label
    return out


def compile_gazetteer(entries: dict[str, str]) -> regex.Pattern[str] | None:
    """One pattern for every form, longest first: CJK forms as substrings, others on word boundaries."""
    if not entries:
        return None
    forms = sorted(entries, key=lambda f: (-len(f), f))
    alts = [regex.escape(f) if _CJK_RE.search(f) else rf"(?<!{_WORDCH}){regex.escape(f)}(?!{_WORDCH})" for f in forms]
    return regex.compile("|".join(alts))


class RuleRecognizer:
    """Spans of the configured pattern kinds and gazetteer entries (score 1.0)."""

    name = "rules"

    def __init__(self, settings: RuleSettings | None = None, base: Path | None = None) -> None:
        self.s = settings or RuleSettings()
        kinds = sorted(set(self.s.kinds), key=_PRIORITY.__getitem__)
        self.patterns = [(regex.compile(PATTERNS[k][1], regex.IGNORECASE if k == "date" else 0),
                          PATTERNS[k][0], _PRIORITY[k]) for k in kinds]
        entries: dict[str, str] = {}
        for path in self.s.gazetteers:
            p = Path(path)
            for form, label in load_gazetteer(p if p.is_absolute() or base is None else base / p).items():
                entries[form] = label  # a later file overrides an earlier one
        self.gazetteer = entries
        self.gazetteer_re = compile_gazetteer(entries)

    def candidates(self, text: str) -> list[tuple[int, int, str, float, int]]:
        """(start, end, label, score, priority) in ``text``'s own offsets; may overlap."""
        norm, index = nfkc_map(text)
        out = []
        if self.gazetteer_re is not None:  # gazetteer names before patterns on a tie
            for m in self.gazetteer_re.finditer(norm):
                s, e = to_original(index, m.start(), m.end())
                out.append((s, e, self.gazetteer[m.group()], 1.0, -1))
        for pat, label, prio in self.patterns:
            for m in pat.finditer(norm):
                s, e = to_original(index, m.start(), m.end())
                out.append((s, e, label, 1.0, prio))
        return out

    def recognize(self, texts: Sequence[str]) -> list[list[Span]]:
        return [resolve_overlaps(self.candidates(t), t) for t in texts]
