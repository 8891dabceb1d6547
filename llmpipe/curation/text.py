"""Language-aware text statistics shared by the quality filters: words, lines, sentences, punctuation.

Word splitting follows what datatrove's spaCy tokenizer produces on spaced scripts closely enough
for the Gopher / FineWeb statistics to agree (punctuation runs become their own tokens, so they
count in ratios the way the published filters count them), and it is CJK-aware: every Han, kana
or Hangul-syllable-free CJK character is one word, so Chinese and Japanese documents are not
"too short" because they have no spaces. The sets are derived from Unicode properties rather than
hand-listed, so they cover every script.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache
from pathlib import Path

import regex

CJK_LANGS = frozenset({"zh", "ja", "yue", "wuu", "lzh"})

# Characters of scripts written without spaces between words (one character = one word).
_CJK_CLASS = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Bopomofo}ー々〆"
# A word: a run of letters/marks/digits (with inner apostrophes, dots in numbers), a single CJK
# character, or a run of the same-kind punctuation/symbols (like "..." or "!!").
_WORD_RE = regex.compile(
    r"https?://\S+?(?=[.,;:!?)\]\"']*(?:\s|$))|[\w.+-]+@[\w-]+(?:\.[\w-]+)+"  # URLs, emails: one token
    rf"|[{_CJK_CLASS}]"
    rf"|(?<=\p{{L}})['’]\p{{L}}+"  # clitics: "it's" -> "it" "'s" (as spaCy splits them)
    rf"|(?:[^\s{_CJK_CLASS}\p{{P}}\p{{S}}]|(?<=[\p{{L}}\p{{N}}])[.,](?=[\p{{L}}\p{{N}}]))+"
    rf"|\.\.+|[^\s{_CJK_CLASS}]",
)
_CJK_RE = regex.compile(rf"[{_CJK_CLASS}]")
# A sentence ends at terminal punctuation followed by space/end; CJK full-width terminals end one anywhere.
# An ellipsis ("...") does not end a sentence; "end.Next" (lower, stop, upper) does, as spaCy splits it.
_SENT_END_RE = regex.compile(
    r"(?<!\.)(?!\.\.)[\p{Sentence_Terminal}]+[\"'”’»)\]」』）]*(?=\s|$)|[。！？｡]+[」』”）]*"
    r"|(?<=\p{Ll})[.!?](?=\p{Lu})")


def _build_terminal() -> frozenset[str]:
    # Sentence terminals all live below U+20000 (the planes above hold only ideographs): scan those.
    chars = "".join(chr(c) for c in range(0x20000) if not 0xD800 <= c < 0xE000)
    return frozenset(regex.findall(r"\p{Sentence_Terminal}", chars))


TERMINAL_PUNCTUATION: frozenset[str] = _build_terminal()
TERMINAL_TUPLE: tuple[str, ...] = tuple(sorted(TERMINAL_PUNCTUATION))


@lru_cache(maxsize=65536)
def is_punct_char(ch: str) -> bool:
    """Punctuation, symbol or control character (what the published filters call a 'symbol')."""
    cat = unicodedata.category(ch)
    return cat[0] in "PS" or cat in ("Cc", "Cf") or ch in TERMINAL_PUNCTUATION


def is_symbol_word(word: str) -> bool:
    """True when a token has no character other than punctuation/symbols (e.g. ``,`` or ``...``)."""
    return all(is_punct_char(c) for c in word)


@lru_cache(maxsize=8)
def split_words(text: str) -> tuple[str, ...]:
    """Words of ``text``; CJK characters count one each. Cached: several filters ask for the same doc."""
    return tuple(_WORD_RE.findall(text))


def cjk_ratio(text: str, sample: int = 4000) -> float:
    """Share of non-space characters that are CJK (on a prefix sample, to stay O(1) on huge docs)."""
    head = text[:sample]
    non_space = sum(1 for c in head if not c.isspace())
    return len(_CJK_RE.findall(head)) / non_space if non_space else 0.0


def is_cjk_doc(text: str, lang: str | None) -> bool:
    """A document written without spaces between words: by its language tag, else by its characters."""
    if lang:
        return lang.split("_")[0] in CJK_LANGS
    return cjk_ratio(text) > 0.3


def count_sentences(text: str) -> int:
    """Sentences in ``text``: runs of sentence-terminal punctuation ending a clause, plus a trailing rest."""
    ends = list(_SENT_END_RE.finditer(text))
    n = len(ends)
    tail = text[ends[-1].end():] if ends else text
    if tail.strip() and any(not is_punct_char(c) for c in tail.strip()):
        n += 1
    return n


def duplicate_stats(items: list[str]) -> tuple[int, int]:
    """(number of repeated elements, characters in them): every occurrence after the first counts."""
    seen: set[str] = set()
    dup_n = dup_chars = 0
    for x in items:
        if x in seen:
            dup_n += 1
            dup_chars += len(x)
        else:
            seen.add(x)
    return dup_n, dup_chars


DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "curation"


def read_word_list(path: str | Path) -> list[str]:
    """One entry per line; blank lines and ``#`` comments skipped. Errors name the file."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: word list not found") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e})") from None
    return [w.strip() for w in raw.splitlines() if w.strip() and not w.lstrip().startswith("#")]


def shipped_list(kind: str, lang: str) -> Path | None:
    """A word list shipped with llmpipe (``kind`` = stopwords | blocklist), or None."""
    p = DATA_DIR / kind / f"{lang}.txt"
    return p if p.is_file() else None


def shipped_languages(kind: str) -> list[str]:
    return sorted(p.stem for p in (DATA_DIR / kind).glob("*.txt"))


@lru_cache(maxsize=64)
def stop_words(lang: str) -> frozenset[str] | None:
    """The shipped stop-word set of a language (None when none ships)."""
    p = shipped_list("stopwords", lang)
    return frozenset(read_word_list(p)) if p else None
