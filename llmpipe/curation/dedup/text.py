"""Text normalization, exact-duplicate hashes and shingles for dedup.

Both dedup passes look at the same normalized text (NFKC, casefolded, runs of whitespace collapsed
to one space), so "Hello  World" and "hello world" are exact duplicates and share every shingle.

Shingles are contiguous byte slices of a per-document buffer, which is what lets the MinHash kernel
hash them without building Python strings:

- spaced scripts: word n-grams of the normalized text; a word n-gram is the slice from the first
  word's start to the last word's end, i.e. the words joined by single spaces;
- CJK / Thai-like scripts: character n-grams of the normalized text with spaces removed.

A text shorter than n words (or characters) has one shingle, the whole buffer; an empty text has
none (its signature is all "empty" values, like a fresh datasketch ``MinHash``).
"""

from __future__ import annotations

import hashlib
import unicodedata

# Scripts and languages written without spaces between words: the one definition quality and safety use too
from llmpipe.curation.text import UNSPACED_LANGS, UNSPACED_RE

CHAR_LANGS = UNSPACED_LANGS


def normalize(text: str) -> str:
    """NFKC, casefold, collapse whitespace: the form both exact and near dedup compare."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def exact_hash(normalized: str) -> int:
    """64-bit hash of the normalized text (collisions ~ n^2 / 2^65: negligible below billions)."""
    digest = hashlib.blake2b(normalized.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def nospace_ratio(text: str, sample: int = 2000) -> float:
    """Share of non-whitespace characters (of the first ``sample``) from scripts written without spaces."""
    head = text[:sample]
    if head.isascii():
        return 0.0
    visible = len(head) - sum(1 for c in head if c.isspace()) if not head.isprintable() else \
        len(head) - head.count(" ")
    if visible <= 0:
        return 0.0
    return len(UNSPACED_RE.findall(head)) / visible


def use_char_shingles(normalized: str, lang: str | None, char_ratio: float) -> bool:
    """Character shingles for CJK-like languages (by ``lang`` metadata, else by script share)."""
    if lang:
        base = lang.split("-")[0].split("_")[0].lower()
        if base in CHAR_LANGS:
            return True
    return nospace_ratio(normalized) >= char_ratio


def shingle_buffer(normalized: str, char_mode: bool) -> bytes:
    """The UTF-8 buffer whose slices are the shingles (spaces dropped in character mode)."""
    text = normalized.replace(" ", "") if char_mode else normalized
    return text.encode("utf-8", "surrogatepass")


def shingles(text: str, *, word_ngram: int = 5, char_ngram: int = 5, lang: str | None = None,
             char_ratio: float = 0.3) -> list[bytes]:
    """Reference shingler in plain Python (tests and the datasketch baseline use it).

    The vectorized path (:func:`llmpipe.curation.dedup.minhash.signatures`) produces the same set.
    """
    norm = normalize(text)
    if use_char_shingles(norm, lang, char_ratio):
        units = list(norm.replace(" ", ""))
        n, sep = char_ngram, ""
    else:
        units = norm.split(" ") if norm else []
        n, sep = word_ngram, " "
    if not units:
        return []
    if len(units) <= n:
        return [sep.join(units).encode("utf-8", "surrogatepass")]
    return [sep.join(units[i : i + n]).encode("utf-8", "surrogatepass") for i in range(len(units) - n + 1)]
