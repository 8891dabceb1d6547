"""Rule-based quality filters with the published defaults: Gopher quality and repetition, C4, FineWeb.

The definitions follow the papers and datatrove's reference implementations (same statistics, same
order of checks, same strict/non-strict comparisons), so decisions agree with datatrove; where they
differ it is on purpose and documented here:

* Words come from :func:`llmpipe.curation.text.split_words` (a regex close to spaCy's English
  tokenizer) instead of a spaCy pipeline per language; runs of Han/kana characters are segmented
  into words (Sudachi for Japanese, jieba's dictionary for Chinese: the tokenizers datatrove's
  spaCy pipelines use). Every rule that counts words or n-grams (Gopher word counts and ratios,
  Gopher n-grams, C4 words per line, FineWeb's list ratio) sees the same words, so a 5-gram is five
  words in every language, not five characters.
* Where the regex and spaCy split differently, the word-based rules can decide differently. On prose
  they agree (``benchmarks/curation_vs_datatrove.py``: 1.0 per rule on the multilingual sample); on
  the standard library's docstrings as written (code-like technical English) Gopher quality agrees
  on 0.969 of the documents and Gopher repetition on 0.956 (C4 0.998, FineWeb 0.9998), because
  spaCy keeps ``to_integral_exact``, ``Decimal('1``, ``--``, ``):``, ``e.g.`` and ``.py`` whole and
  splits ``cannot`` and ``don't`` (``do n't``), which moves the alpha-word share (0.8) and the top
  n-gram shares of such documents across their thresholds. Joining underscores and runs of the same
  punctuation would raise them only to 0.977 / 0.965; reaching spaCy's split means its tokenizer's
  prefix/suffix/infix rules and exceptions, at spaCy's cost (datatrove's chain spends most of its
  time there).
* A document is split into words once for every filter (:func:`llmpipe.curation.text.doc_words`,
  cached a few batches deep); C4's rewritten text (its kept lines) gets the kept lines' words, which
  are its words (no word spans two lines), so FineWeb does not split it again.
* Runs of Thai, Lao, Khmer and Burmese are segmented into words too (ICU's dictionary break
  iterator), so a Thai paragraph is its words, not its space-separated phrases.
* For documents written without spaces (``lang`` from langid in
  :data:`llmpipe.curation.text.UNSPACED_LANGS`, or mostly such characters: CJK, Thai, Lao, Khmer,
  Burmese; the scores' ``cjk`` flag) the mean-word-length rule is skipped (Chinese and Japanese
  words average under two characters; Gopher's 3-10 bounds are for spaced scripts) and stop words
  are the language's own, matched as substrings; C4 accepts CJK sentence terminals and counts
  segmented words per line (its ``line.split()`` sees one word per unspaced line).
* The stop-word rule counts distinct stop words (``len(stop_words & set(words))``), as datatrove
  0.10 does; datatrove 0.2 counted occurrences (``sum(w in stop_words for w in words)``), which
  lets a page that repeats "the" pass with no other stop word.
* Duplicate n-grams are compared as word tuples (datatrove joins words without a separator, which
  can merge different n-grams), counted in ``Counter``s of the tuples (documents are a few hundred
  words: numpy's per-call cost was most of the filter).
  A top n-gram's characters include the spaces between its words only in spaced scripts.

Every filter computes all its statistics (``scores``) before deciding, and the scores are kept in
``doc.metadata["scores"][name]``, so thresholds can be re-applied later with ``decide`` alone.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Collection, Sequence
from itertools import chain
from operator import methodcaller
from typing import Any

from llmpipe.curation.config import (
    C4Settings,
    FineWebSettings,
    GopherQualitySettings,
    GopherRepetitionSettings,
    QualityConfig,
)
from llmpipe.curation.filters import Filter, ScoredFilter
from llmpipe.curation.text import (
    TERMINAL_TUPLE,
    BoundedMemo,
    cached_doc_words,
    check_segmenters,
    count_sentences,
    duplicate_stats,
    is_symbol_word,
    is_unspaced_doc,
    remember_words,
    segmenter_lang,
    split_words,
    stop_words,
    unspaced_lang,
    words_of,
)
from llmpipe.document import Document

_ALPHA = re.compile(r"[^\W\d_]")


_FIELD = 64  # bits per term of a packed word kind: a document's sums stay far below 2**64
_FIELD_MASK = (1 << _FIELD) - 1


def _word_kind(word: str) -> int:
    """The three terms the Gopher quality counts add up over a document's words, packed in one int: 1
    if the word has a letter (bits 0-63), 1 if it is not a symbol word (64-127), its length if it is
    not a symbol word else 0 (128-). One addition per word sums all three (Python ints do not
    overflow, and no field's sum reaches 2**64, so the fields never carry: the same integers as
    three sums). Cached (``_WORD_KINDS``): the per-character test of :func:`is_symbol_word` was a
    fifth of the Gopher quality filter."""
    if word.isascii() and word.isalnum():  # most words: letters and digits, never a symbol
        return int(not word.isdigit()) | 1 << _FIELD | len(word) << 2 * _FIELD
    non_symbol = not is_symbol_word(word)
    return int(_ALPHA.search(word) is not None) | int(non_symbol) << _FIELD | (len(word) if non_symbol else 0) << 2 * _FIELD


_WORD_KINDS = BoundedMemo(_word_kind)  # documents share most of their words


def _share_of_lines(lines: list[str], text: str, marks: tuple[str, ...], starts: bool) -> float:
    """Share of ``lines`` that start (after leading space) / end (before trailing space) with one of
    ``marks``; 0.0 at once when no mark occurs in ``text`` (most documents: no per-line scan)."""
    if not any(m in text for m in marks):
        return 0.0
    if starts:  # map + methodcaller: the per-line loop runs in C
        return sum(map(methodcaller("startswith", marks), map(str.lstrip, lines))) / len(lines)
    return sum(map(methodcaller("endswith", marks), map(str.rstrip, lines))) / len(lines)


def doc_lang(doc: Document, default: str) -> str:
    lang = doc.metadata.get("lang")
    return lang if isinstance(lang, str) and lang and lang not in ("und", "code") else default


def _gt(value: float | None, limit: float | None) -> bool:
    """value > limit, where a disabled rule (limit None/0) or an undefined value never fires."""
    return bool(limit) and value is not None and value > limit  # type: ignore[operator]


def _lt(value: float | None, limit: float | None) -> bool:
    return bool(limit) and value is not None and value < limit  # type: ignore[operator]


class GopherQualityFilter(ScoredFilter):
    """Gopher quality: word-count bounds, mean word length, symbol ratios, bullets, ellipses, alpha, stop words."""

    name = "gopher_quality"

    def __init__(self, settings: GopherQualitySettings | None = None, default_lang: str = "en") -> None:
        self.s = settings or GopherQualitySettings()
        self.default_lang = default_lang
        self._stop: dict[str, frozenset[str] | None] = {}

    def _stop_words(self, lang: str) -> frozenset[str] | None:
        if lang not in self._stop:
            given = self.s.stop_words.get(lang)
            self._stop[lang] = frozenset(given) if given is not None else stop_words(lang)
        return self._stop[lang]

    def scores(self, doc: Document) -> dict[str, Any]:
        text = doc.text
        if self.s.max_doc_words and len(text) > 20 * self.s.max_doc_words:
            # Fast path for huge docs: whitespace chunks bound the word count; far over the limit, the
            # precise (slow) tokenization cannot change the decision.
            n_chunks = len(text.split())
            if n_chunks > 2 * self.s.max_doc_words:
                return {"lang": doc_lang(doc, self.default_lang), "cjk": False, "n_words": n_chunks,
                        "estimated": True, "avg_word_length": None, "hash_ratio": None, "ellipsis_ratio": None,
                        "bullet_lines_ratio": None, "ellipsis_lines_ratio": None, "alpha_words_ratio": None,
                        "n_stop_words": None}
        tagged = bool(doc.metadata.get("lang")) and doc_lang(doc, "") != ""
        lang = doc_lang(doc, self.default_lang)
        cjk = is_unspaced_doc(text, lang if tagged else None)
        words = split_words(text, lang)  # the same (text, lang) key as the other filters: one segmentation
        if cjk and not tagged:  # untagged unspaced text: Japanese when it has kana, Chinese, Thai, ...
            lang = unspaced_lang(text)
        n_words = len(words)
        # every word's packed kind (a cache hit for all but a document's new words), summed: map/sum
        # loop in C (a Python loop over the distinct words was a third of the filter, counting them
        # first half of what is left); integer sums, so exact
        total = sum(map(_WORD_KINDS.__getitem__, words))
        n_alpha, n_non_symbol = total & _FIELD_MASK, total >> _FIELD & _FIELD_MASK
        chars_non_symbol = total >> 2 * _FIELD
        lines = text.splitlines() or [""]
        stops = self._stop_words(lang)
        if stops is None:
            n_stop = None
        elif cjk:
            n_stop = sum(1 for w in stops if w in text)
        else:
            n_stop = len(stops.intersection(words))  # distinct stop words (see the module docstring)
        per_word = 1 / n_words if n_words else None
        return {
            "lang": lang,
            "cjk": cjk,
            "n_words": n_non_symbol,
            "avg_word_length": chars_non_symbol / n_non_symbol if n_non_symbol else None,
            "hash_ratio": text.count("#") * per_word if per_word else None,
            "ellipsis_ratio": (text.count("...") + text.count("…")) * per_word if per_word else None,
            "bullet_lines_ratio": _share_of_lines(lines, text, ("•", "-"), starts=True),
            "ellipsis_lines_ratio": _share_of_lines(lines, text, ("...", "…"), starts=False),
            "alpha_words_ratio": n_alpha * per_word if per_word else None,
            "n_stop_words": n_stop,
        }

    def decide(self, sc: dict[str, Any]) -> str | None:
        s = self.s
        if s.min_doc_words and sc["n_words"] < s.min_doc_words:
            return "gopher_short_doc"
        if _gt(sc["n_words"], s.max_doc_words):
            return "gopher_long_doc"
        if not sc["cjk"]:
            if _lt(sc["avg_word_length"], s.min_avg_word_length):
                return "gopher_below_avg_word_length"
            if _gt(sc["avg_word_length"], s.max_avg_word_length):
                return "gopher_above_avg_word_length"
        if _gt(sc["hash_ratio"], s.max_symbol_word_ratio):
            return "gopher_too_many_hashes"
        if _gt(sc["ellipsis_ratio"], s.max_symbol_word_ratio):
            return "gopher_too_many_ellipsis"
        if _gt(sc["bullet_lines_ratio"], s.max_bullet_lines_ratio):
            return "gopher_too_many_bullets"
        if _gt(sc["ellipsis_lines_ratio"], s.max_ellipsis_lines_ratio):
            return "gopher_too_many_end_ellipsis"
        if _lt(sc["alpha_words_ratio"], s.min_alpha_words_ratio):
            return "gopher_below_alpha_threshold"
        if s.min_stop_words and sc["n_stop_words"] is not None and sc["n_stop_words"] < s.min_stop_words:
            return "gopher_not_enough_stop_words"
        return None


# -- Gopher repetition -------------------------------------------------------------------------
_PARA_RE = re.compile(r"\n{2,}")
_LINE_RE = re.compile(r"\n+")
def _ngrams(words: tuple[str, ...], n: int) -> list[tuple[str, ...]]:
    """Every n-gram of ``words`` as a word tuple, in order (``zip`` over shifted views: a C loop)."""
    return list(zip(*[words[i:] for i in range(n)], strict=False))  # the shifted views end early


def _ngram_chars(words: tuple[str, ...], top_sizes: Collection[int], dup_sizes: Collection[int],
                 sep: int = 1) -> tuple[dict[int, int], dict[int, int]]:
    """({n: characters covered by the most frequent n-gram} for ``top_sizes``, {n: characters in
    repeated n-grams} for ``dup_sizes``), each size up to ``len(words)`` (larger ones are left out).

    Top n-gram: its words plus n-1 separators of ``sep`` characters, times its count; ties go to the
    first seen; with no n-gram repeated, the first n-gram once. Duplicates: Gopher's scan, left to
    right, a repeat counts its words' characters and the scan skips past it.

    Only n-grams that occur more than once can be a top n-gram seen more than once, a repeat, or make
    a later repeat, and an (n+k)-gram that repeats starts with an n-gram that repeats, at every one of
    its positions. So one count of every n-gram of the smallest size is enough: each larger size
    counts only the n-grams at the positions where the size before repeated (in order, so first-seen
    order holds), a document's few repeats instead of its every word (on most documents none: every
    larger size is decided at once)."""
    out_top: dict[int, int] = {}
    out_dup: dict[int, int] = {}
    pos: Sequence[int] | None = None  # the positions that can start a repeated n-gram (None: all)
    for n in sorted({n for n in (*top_sizes, *dup_sizes) if n <= len(words)}):
        if pos is None:
            grams = _ngrams(words, n)
            pos = range(len(grams))
        elif not pos:  # nothing repeats at this size or beyond: the first n-gram once, no duplicate
            if n in top_sizes:
                out_top[n] = sum(map(len, words[:n])) + (n - 1) * sep
            if n in dup_sizes:
                out_dup[n] = 0
            continue
        else:
            pos = pos[: bisect_right(pos, len(words) - n)]  # ascending: those where an n-gram fits
            grams = [words[p : p + n] for p in pos]
        counts = Counter(grams)
        repeated = [] if len(counts) == len(grams) else [(p, g) for p, g in zip(pos, grams, strict=True) if counts[g] > 1]
        if n in top_sizes:
            best, gram = 1, words[:n]
            if repeated:
                best = max(counts.values())
                gram = next(g for g, c in counts.items() if c == best)
            out_top[n] = (sum(map(len, gram)) + (n - 1) * sep) * best
        if n in dup_sizes:
            out_dup[n] = _dup_scan(repeated, n)
        pos = [p for p, _ in repeated]
    return out_top, out_dup


def _dup_scan(repeated: list[tuple[int, tuple[str, ...]]], n: int) -> int:
    """Gopher's duplicate n-gram scan over the (position, n-gram) of every n-gram seen more than once,
    in order: the n-grams seen once can neither count nor be skipped into."""
    seen: set[tuple[str, ...]] = set()
    total, nxt = 0, 0  # nxt: the scan's next position
    for p, g in repeated:
        if p < nxt:  # skipped: inside a repeat counted before
            continue
        if g in seen:
            total += sum(map(len, g))
            nxt = p + n
        else:
            seen.add(g)
            nxt = p + 1
    return total


class GopherRepetitionFilter(ScoredFilter):
    """Gopher repetition: duplicate lines/paragraphs (count and chars), top n-grams, duplicate n-grams."""

    name = "gopher_repetition"

    def __init__(self, settings: GopherRepetitionSettings | None = None, default_lang: str = "en") -> None:
        self.s = settings or GopherRepetitionSettings()
        self.default_lang = default_lang

    def scores(self, doc: Document) -> dict[str, Any]:
        text = doc.text
        lang = doc_lang(doc, self.default_lang)
        sep = 0 if is_unspaced_doc(text, doc.metadata.get("lang") and lang) else 1  # unspaced words touch
        n_chars = max(len(text), 1)
        paras = _PARA_RE.split(text.strip())
        p_dup, p_chars = duplicate_stats(paras)
        lines = _LINE_RE.split(text)
        l_dup, l_chars = duplicate_stats(lines)
        words = split_words(text, lang)
        top_chars, dup_chars = _ngram_chars(words, self.s.top_n_grams, self.s.dup_n_grams, sep)
        top = {n: top_chars[n] / n_chars if n in top_chars else 0.0 for n in self.s.top_n_grams}
        dup = {n: dup_chars[n] / n_chars if n in dup_chars else 0.0 for n in self.s.dup_n_grams}
        return {
            "dup_para_frac": p_dup / len(paras),
            "dup_para_char_frac": p_chars / n_chars,
            "dup_line_frac": l_dup / len(lines),
            "dup_line_char_frac": l_chars / n_chars,
            "top_n_gram_char_frac": {str(n): top[n] for n in self.s.top_n_grams},
            "dup_n_gram_char_frac": {str(n): dup[n] for n in self.s.dup_n_grams},
        }

    def decide(self, sc: dict[str, Any]) -> str | None:
        s = self.s
        for key in ("dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac"):
            if _gt(sc[key], getattr(s, key)):
                return key
        for n, frac in s.top_n_grams.items():
            if sc["top_n_gram_char_frac"][str(n)] > frac:
                return f"top_{n}_gram"
        for n, frac in s.dup_n_grams.items():
            if sc["dup_n_gram_char_frac"][str(n)] > frac:
                return f"duplicated_{n}_n_grams"
        return None


# -- C4 -----------------------------------------------------------------------------------------
_CITATION_RE = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_END_PUNCT = (".", "?", "!", '"', "'")
_CJK_END_PUNCT = _END_PUNCT + ("。", "！", "？", "」", "』", "”", "）")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
# (the filter searches the two without "cookie" first, the others only in a line with "cookie": the same
# lines, a third of the searches; a test checks the phrases)


class C4QualityFilter(ScoredFilter):
    """C4: keep lines ending in terminal punctuation with >= 3 words and no javascript/policy text; drop
    pages with lorem ipsum or a curly bracket, or with < 5 sentences left. With ``remove_lines`` the kept
    document's text becomes its kept lines, as in C4."""

    name = "c4"

    def __init__(self, settings: C4Settings | None = None, default_lang: str = "en") -> None:
        self.s = settings or C4Settings()
        self.default_lang = default_lang

    def _lines(self, doc: Document, want_words: bool = False
               ) -> tuple[dict[str, Any], list[str], list[tuple[str, ...]] | None]:
        """(scores, kept lines, the kept lines' words): the words only with ``want_words``, and only
        where the document's words by line are at hand (split by a filter before, no unspaced
        script), else None."""
        s = self.s
        lang = doc_lang(doc, self.default_lang)
        cjk = is_unspaced_doc(doc.text, doc.metadata.get("lang") and lang)
        seg = segmenter_lang(doc.text, lang) if cjk else None
        ends = _CJK_END_PUNCT if cjk else _END_PUNCT
        dropped: Counter[str] = Counter()
        kept: list[str] = []
        split = cached_doc_words(doc.text, lang) if want_words else None
        by_line = split if split is not None and split.line_ends is not None else None
        kept_words: list[tuple[str, ...]] | None = [] if by_line is not None else None
        n_sent, doc_rule = 0, None
        lines = doc.text.splitlines()
        for i, line in enumerate(lines):
            line = line.strip()
            if seg:
                words = words_of(line, seg)
                n_words = len(words)
                too_long = s.max_word_length != -1 and bool(words) and max(map(len, words)) > s.max_word_length
            else:  # C4's words: whitespace-separated
                too_long = s.max_word_length != -1 and len(line) > s.max_word_length and max(
                    map(len, line.split())) > s.max_word_length  # no word is longer than its line
                # only whether there are min_words_per_line words: split no further (the count is exact below it)
                n_words = len(line.split(None, s.min_words_per_line))
            if too_long:
                dropped["too_long_word"] += 1
                continue
            cited = False
            if s.remove_citations and "[" in line:  # every citation starts with one
                n = len(line)
                line = _CITATION_RE.sub("", line)
                cited = len(line) != n  # every citation match has characters
            if s.filter_no_terminal_punct and (not line.endswith(ends) or line.endswith("...")):
                dropped["no_terminal_punct"] += 1
                continue
            if n_words < s.min_words_per_line:
                dropped["too_few_words"] += 1
                continue
            low = line.lower()
            if s.filter_lorem_ipsum and "lorem ipsum" in low:
                doc_rule = "lorem_ipsum"
                break
            if s.filter_javascript and "javascript" in low:
                dropped["javascript"] += 1
                continue
            if s.filter_curly_bracket and "{" in line:
                doc_rule = "curly_bracket"
                break
            if s.filter_policy and ("terms of use" in low or "privacy policy" in low
                                    or ("cookie" in low and any(p in low for p in _POLICY))):
                dropped["policy"] += 1
                continue
            n_sent += count_sentences(line)
            kept.append(line)
            if kept_words is not None and by_line is not None:  # a line without citations keeps its words
                kept_words.append(words_of(line, lang) if cited else by_line.line(i))
        scores = {"cjk": cjk, "lines": len(lines), "lines_kept": len(kept), "lines_dropped": dict(dropped),
                  "n_sentences": n_sent, "doc_rule": doc_rule}
        return scores, kept, kept_words

    def scores(self, doc: Document) -> dict[str, Any]:
        return self._lines(doc)[0]

    def decide(self, sc: dict[str, Any]) -> str | None:
        if sc["doc_rule"]:
            return sc["doc_rule"]
        if self.s.min_num_sentences != -1 and sc["n_sentences"] < self.s.min_num_sentences:
            return "too_few_sentences"
        return None

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        sc, kept, kept_words = self._lines(doc, want_words=self.s.remove_lines)
        self.set_scores(doc, sc)
        reason = self.decide(sc)
        if reason is not None:
            return False, reason
        if self.s.remove_lines and sc["lines_kept"] != sc["lines"]:
            doc.text = "\n".join(kept).strip()
            if kept_words is not None:  # the new text's words, for the filters after (FineWeb): no new split
                remember_words(doc.text, doc_lang(doc, self.default_lang), tuple(chain.from_iterable(kept_words)))
        return True


# -- FineWeb ------------------------------------------------------------------------------------
class FineWebQualityFilter(ScoredFilter):
    """FineWeb: share of lines ending in punctuation, of short lines, duplicated line chars, list-likeness."""

    name = "fineweb"

    def __init__(self, settings: FineWebSettings | None = None, default_lang: str = "en") -> None:
        self.s = settings or FineWebSettings()
        self.default_lang = default_lang

    def scores(self, doc: Document) -> dict[str, Any]:
        text = doc.text
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if not lines:
            return {"empty": True}
        n = len(lines)
        words = split_words(text, doc_lang(doc, self.default_lang))
        return {
            "empty": False,
            "line_punct_ratio": sum(1 for ln in lines if ln.endswith(TERMINAL_TUPLE)) / n,
            "short_line_ratio": sum(1 for ln in lines if len(ln) <= self.s.short_line_length) / n,
            "char_dup_ratio": duplicate_stats(lines)[1] / max(len(text) - text.count("\n"), 1),
            "list_ratio": text.count("\n") / max(len(words), 1),
        }

    def decide(self, sc: dict[str, Any]) -> str | None:
        s = self.s
        if sc["empty"]:
            return "empty"
        r = sc["line_punct_ratio"]
        if s.line_punct_thr is not None and r < s.line_punct_thr and not (r == 0 and s.line_punct_exclude_zero):
            return "line_punct_ratio"
        if _gt(sc["short_line_ratio"], s.short_line_thr):
            return "short_line_ratio"
        if _gt(sc["char_dup_ratio"], s.char_duplicates_ratio):
            return "char_dup_ratio"
        if _gt(sc["list_ratio"], s.new_line_ratio):
            return "list_ratio"
        return None


def build_quality_filters(cfg: QualityConfig) -> list[Filter]:
    """The configured quality filters, in the configured order."""
    if cfg.filters:  # every filter counts words
        check_segmenters()
    make = {
        "gopher_quality": lambda: GopherQualityFilter(cfg.gopher_quality, cfg.default_lang),
        "gopher_repetition": lambda: GopherRepetitionFilter(cfg.gopher_repetition, cfg.default_lang),
        "c4": lambda: C4QualityFilter(cfg.c4, cfg.default_lang),
        "fineweb": lambda: FineWebQualityFilter(cfg.fineweb, cfg.default_lang),
    }
    return [make[name]() for name in cfg.filters]


def rejudge(filters: Sequence[ScoredFilter], doc: Document) -> str | None:
    """Re-apply (possibly new) thresholds to a document's stored scores, without recomputing them."""
    stored = doc.metadata.get("scores", {})
    for f in filters:
        if f.name in stored:
            reason = f.decide(stored[f.name])
            if reason is not None:
                return reason
    return None
