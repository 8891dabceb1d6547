"""Language-aware text statistics shared by the quality filters: words, lines, sentences, punctuation.

Word splitting follows what datatrove's spaCy tokenizer produces on spaced scripts closely enough
for the Gopher / FineWeb statistics to agree (punctuation runs become their own tokens, so they
count in ratios the way the published filters count them). Runs of Han / kana characters, which
are written without spaces, go through a real word segmenter, as datatrove's per-language spaCy
tokenizers do: Sudachi (``sudachipy`` + the ``sudachidict_core`` dictionary wheel, split mode C,
spaCy's and datatrove's Japanese tokenizer) for Japanese and jieba's algorithm and dictionary
(``rjieba``, the Rust port, the same cuts at ~25x the speed) for Chinese. Counting one word per
character instead made a "5-gram" five characters, so ordinary katakana words (オプション) repeated
as whole n-grams and the repetition rules rejected ordinary Japanese prose; with words, every
language's n-grams, word counts and ratios mean the same thing. Runs of Thai, Lao, Khmer and
Burmese (Myanmar script), also written without spaces between words, go through ICU's word break
iterator (``pyicu-wheels``: PyICU with ICU bundled), whose dictionary-based break engines cover all
four; counting each space-separated phrase as one word made a Thai paragraph 18 "words" of 58
characters, rejected as too short. Every dictionary ships inside its wheel, so segmentation works
offline. The character sets are derived from Unicode properties rather than hand-listed, so they
cover every script.

One definition of the scripts written without spaces serves every stage (quality, safety, dedup):
:data:`UNSPACED_LANGS` (language tags), :data:`UNSPACED_RANGES` / :data:`UNSPACED_RE` (code point
ranges from the Unicode script properties, for the standard ``re`` module) and
:func:`is_unspaced_doc` / :func:`unspaced_ratio`.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

import regex

CJK_LANGS = frozenset({"zh", "ja", "yue", "wuu", "lzh"})
SEA_LANGS = frozenset({"th", "lo", "km", "my"})  # Thai, Lao, Khmer, Burmese
UNSPACED_LANGS = CJK_LANGS | SEA_LANGS  # languages written without spaces between words

# Characters of scripts written without spaces between words (their runs go to a word segmenter).
_CJK_CLASS = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Bopomofo}ー々〆"
_SEA_CLASS = r"\p{Thai}\p{Lao}\p{Khmer}\p{Myanmar}"
_UNSPACED_CLASS = _CJK_CLASS + _SEA_CLASS


def _script_ranges(char_class: str, top: int = 0x40000) -> tuple[tuple[int, int], ...]:
    """The code point ranges (inclusive) of a ``regex`` character class, below ``top`` (the planes
    above hold no letters)."""
    chars = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, top)))  # no surrogates
    return tuple((ord(m.group()[0]), ord(m.group()[-1])) for m in regex.finditer(f"[{char_class}]+", chars))


# The unspaced scripts' characters as code point ranges (inclusive), for code that matches with the
# standard ``re`` module (dedup's shingles): the ranges of ``_UNSPACED_CLASS`` under the Unicode
# version of the ``regex`` module, written out so that no process pays ~0.2 s to derive them (a test
# derives them again and compares: a newer Unicode that adds characters fails it, naming the new ranges).
UNSPACED_RANGES: tuple[tuple[int, int], ...] = (
    (0x02EA, 0x02EB), (0x0E01, 0x0E3A), (0x0E40, 0x0E5B), (0x0E81, 0x0E82), (0x0E84, 0x0E84),
    (0x0E86, 0x0E8A), (0x0E8C, 0x0EA3), (0x0EA5, 0x0EA5), (0x0EA7, 0x0EBD), (0x0EC0, 0x0EC4),
    (0x0EC6, 0x0EC6), (0x0EC8, 0x0ECE), (0x0ED0, 0x0ED9), (0x0EDC, 0x0EDF), (0x1000, 0x109F),
    (0x1780, 0x17DD), (0x17E0, 0x17E9), (0x17F0, 0x17F9), (0x19E0, 0x19FF), (0x2E80, 0x2E99),
    (0x2E9B, 0x2EF3), (0x2F00, 0x2FD5), (0x3005, 0x3007), (0x3021, 0x3029), (0x3038, 0x303B),
    (0x3041, 0x3096), (0x309D, 0x309F), (0x30A1, 0x30FA), (0x30FC, 0x30FF), (0x3105, 0x312F),
    (0x31A0, 0x31BF), (0x31F0, 0x31FF), (0x32D0, 0x32FE), (0x3300, 0x3357), (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF), (0xA9E0, 0xA9FE), (0xAA60, 0xAA7F), (0xF900, 0xFA6D), (0xFA70, 0xFAD9),
    (0xFF66, 0xFF6F), (0xFF71, 0xFF9D), (0x116D0, 0x116E3), (0x16FE2, 0x16FE3), (0x16FF0, 0x16FF6),
    (0x1AFF0, 0x1AFF3), (0x1AFF5, 0x1AFFB), (0x1AFFD, 0x1AFFE), (0x1B000, 0x1B128), (0x1B132, 0x1B132),
    (0x1B150, 0x1B152), (0x1B155, 0x1B155), (0x1B164, 0x1B168), (0x1F200, 0x1F200), (0x20000, 0x2A6DF),
    (0x2A700, 0x2B81E), (0x2B820, 0x2CEAD), (0x2CEB0, 0x2EBE0), (0x2EBF0, 0x2EE5D), (0x2F800, 0x2FA1D),
    (0x30000, 0x3134A), (0x31350, 0x33479),
)


def _ranges_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


# One character of those ranges. The ranges above U+FFFF are tested only on a character above U+FFFF
# (the lookbehind): in one class with the others, every character of a text paid for them (``re``
# keeps a bitmap for the BMP ranges, a list for the rest), 4x the time of the search.
UNSPACED_RE = re.compile(f"[{_ranges_class(tuple(r for r in UNSPACED_RANGES if r[1] <= 0xFFFF))}]"
                         f"|[\U00010000-\U0010FFFF](?<=[{_ranges_class(tuple(r for r in UNSPACED_RANGES if r[1] > 0xFFFF))}])")


def _word_re(unspaced: str, links: bool = True) -> regex.Pattern[str]:
    """A word: a run of letters/marks/digits (with inner apostrophes, dots in numbers), a run of one
    unspaced script (segmented afterwards), or a run of the same-kind punctuation/symbols ("..." or
    "!!"); ``unspaced`` is the class of the characters that never join a spaced word. Without
    ``links``, the URL and e-mail alternatives are left out: the pattern for a text with no ``://``
    and no ``@``, where they cannot match, so it finds the same words without trying them at every
    word (the e-mail one scans each word to its end looking for an ``@``).

    The run of word characters, ``(?:char|dot)+`` (``dot``: a ``.`` or ``,`` between two letters or
    digits), is written ``char+(?:dot char*)*``, with ``dot(?:char|dot)*`` for the rare run that starts
    at a dot: the same runs, but the engine loops over a plain character class instead of trying two
    alternatives and a lookbehind at every character (~1.7x faster). It comes first after the links:
    none of the alternatives it now precedes can match where it can (they start at an unspaced
    character, an apostrophe, two dots, or a character no other alternative takes), so the same
    alternative matches at every position."""
    head = r"https?://\S+?(?=[.,;:!?)\]\"']*(?:\s|$))|[\w.+-]+@[\w-]+(?:\.[\w-]+)+|" if links else ""
    char, dot = rf"[^\s{unspaced}\p{{P}}\p{{S}}]", r"(?<=[\p{L}\p{N}])[.,](?=[\p{L}\p{N}])"
    return regex.compile(
        head  # URLs, emails: one token
        + rf"{char}+(?:{dot}{char}*)*|{dot}(?:{char}|{dot})*"
        rf"|[{_CJK_CLASS}]+|[{_SEA_CLASS}]+"
        rf"|(?<=\p{{L}})['’]\p{{L}}+"  # clitics: "it's" -> "it" "'s" (as spaCy splits them)
        rf"|\.\.+|[^\s{unspaced}]",
    )


# A superset of ``UNSPACED_RE`` in one class (its BMP ranges and every character above U+FFFF): half
# its time to search a text, so a text it does not match (most: Latin with a curly quote or a dash) is
# known to hold no unspaced character at that cost; a match is confirmed by ``UNSPACED_RE``.
_MAYBE_UNSPACED_RE = re.compile(f"[{_ranges_class(tuple(r for r in UNSPACED_RANGES if r[1] <= 0xFFFF))}"
                                "\U00010000-\U0010FFFF]")


def has_unspaced(text: str) -> bool:
    """Whether ``text`` holds a character of a script written without spaces (``UNSPACED_RE``)."""
    return not text.isascii() and _MAYBE_UNSPACED_RE.search(text) is not None and UNSPACED_RE.search(text) is not None


_WORD_RE = _word_re(_UNSPACED_CLASS)
# The same words for a text without a Thai/Lao/Khmer/Myanmar character, ~20% faster (four fewer
# script properties to test per character); ``_SEA_BLOCKS`` holds every character of those scripts.
_WORD_RE_NO_SEA = _word_re(_CJK_CLASS)
_WORD_RE_PLAIN = _word_re(_UNSPACED_CLASS, links=False)  # the same two, for text without "://" and "@"
_WORD_RE_NO_SEA_PLAIN = _word_re(_CJK_CLASS, links=False)
_SEA_BLOCKS = re.compile("[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u19e0-\u19ff\ua9e0-\ua9ff\uaa60-\uaa7f"
                         "\U000116d0-\U000116ff]")  # the scripts' Unicode blocks (a test checks them)


def _ascii_class(char_class: str) -> str:
    """The ASCII characters that ``char_class`` matches under the ``regex`` module, written out as the
    body of a standard ``re`` character class (so both modules see exactly the same characters)."""
    chars = (chr(c) for c in range(128))
    return "".join(re.escape(c) for c in chars if regex.fullmatch(char_class, c))


def _ascii_word_re(links: bool = True) -> re.Pattern[str]:
    """:func:`_word_re` for pure-ASCII text, on the standard ``re`` module (about 2.5x faster there:
    no Unicode property to test per character). Same alternatives, in the same order, each class
    reduced to its ASCII members (the unspaced scripts and the curly apostrophe have none); a test
    compares the tokens with ``_WORD_RE``'s on every ASCII character and on random ASCII strings.
    ``links``: as in :func:`_word_re`."""
    s, ns, ln = _ascii_class(r"\s"), _ascii_class(r"\S"), _ascii_class(r"[\p{L}\p{N}]")
    word, dom, letter = _ascii_class(r"[\w.+-]"), _ascii_class(r"[\w-]"), _ascii_class(r"\p{L}")
    char, dot = "[" + _ascii_class(r"[^\s\p{P}\p{S}]") + "]", rf"(?<=[{ln}])[.,](?=[{ln}])"
    head = rf"https?://[{ns}]+?(?=[.,;:!?)\]\"']*(?:[{s}]|$))|[{word}]+@[{dom}]+(?:\.[{dom}]+)+|" if links else ""
    return re.compile(
        head
        + rf"{char}+(?:{dot}{char}*)*|{dot}(?:{char}|{dot})*"
        rf"|(?<=[{letter}])'[{letter}]+"
        rf"|\.\.+|[{ns}]")


_WORD_RE_ASCII = _ascii_word_re()
_WORD_RE_ASCII_PLAIN = _ascii_word_re(links=False)
# ASCII whitespace that ``str.split()`` cuts at and the word patterns' ``\s`` does not (Unicode's
# White_Space leaves out the four information separators): a text with one is split by the pattern alone
_SPLIT_ONLY_SPACE = ("\x1c", "\x1d", "\x1e", "\x1f")


class BoundedMemo(dict[Any, Any]):
    """``fn(key)`` by key, cached in a plain dict (a hit is a lookup in C, half an ``lru_cache`` hit's
    cost); emptied when it reaches ``max_entries``, so memory stays bounded whatever the corpus; a key
    ``keep`` refuses is computed and not kept. For the per-word and per-chunk work that real text
    repeats (its words, its whitespace-free chunks)."""

    def __init__(self, fn: Callable[[Any], Any], max_entries: int = 1 << 17,
                 keep: Callable[[Any], bool] | None = None) -> None:
        super().__init__()
        self.fn, self.max_entries, self.keep = fn, max_entries, keep

    def __missing__(self, key: Any) -> Any:
        value = self.fn(key)
        if self.keep is None or self.keep(key):
            if len(self) >= self.max_entries:
                self.clear()
            self[key] = value
        return value


def _chunk_tokens(chunk: str) -> list[str]:
    """``_WORD_RE.findall(chunk)`` for a chunk of text without whitespace, by the fastest pattern that
    finds the same tokens there: the ``re`` one for ASCII, the one without the four Southeast Asian
    scripts where none is, each without the URL / e-mail alternatives where the chunk has no ``://``
    and no ``@`` (tests compare each with ``_WORD_RE`` on random text)."""
    links = "://" in chunk or "@" in chunk
    if chunk.isascii():
        return (_WORD_RE_ASCII if links else _WORD_RE_ASCII_PLAIN).findall(chunk)
    if _SEA_BLOCKS.search(chunk):
        return (_WORD_RE if links else _WORD_RE_PLAIN).findall(chunk)
    return (_WORD_RE_NO_SEA if links else _WORD_RE_NO_SEA_PLAIN).findall(chunk)


# The tokens of a whitespace-free chunk of text, cached (bounded; long chunks, URLs, minified code or a
# sentence of an unspaced script, are rare or do not repeat: not kept).
#
# No token holds whitespace, and no alternative or lookaround of the word patterns tells whitespace
# from the start or end of the string, so a text's tokens are its chunks' tokens in order (``str.split``
# cuts at exactly the patterns' whitespace plus the four information separators, which send a text to
# the pattern instead). Real text repeats its chunks ("the", "of", "function.", "don’t"), so most are a
# dict lookup instead of a pattern run: ~1.4x faster than the pattern on ASCII text, and a text with a
# curly quote or an accent (three in four of real English documents) takes the same path, where the
# ``regex`` pattern over its lines cost ~3x the ``re`` one.
_CHUNKS = BoundedMemo(_chunk_tokens, keep=lambda chunk: len(chunk) <= 64)
_SPLIT_ONLY_RE = re.compile("[" + "".join(_SPLIT_ONLY_SPACE) + "]")


def _whole_pattern(text: str) -> regex.Pattern[str]:
    """The word pattern for a whole text: what :func:`_chunk_tokens` picks for a chunk, for the text."""
    links = "://" in text or "@" in text
    if _SEA_BLOCKS.search(text):
        return _WORD_RE if links else _WORD_RE_PLAIN
    return _WORD_RE_NO_SEA if links else _WORD_RE_NO_SEA_PLAIN


def _tokens(text: str) -> list[str]:
    """``_WORD_RE.findall(text)``: the tokens of the text's whitespace-free chunks, in order (see
    ``_CHUNKS``); a text with an information separator (whitespace to ``str.split`` only) goes to
    the pattern whole."""
    if _SPLIT_ONLY_RE.search(text):
        return _whole_pattern(text).findall(text)
    return list(chain.from_iterable(map(_CHUNKS.__getitem__, text.split())))


def _line_tokens(text: str) -> tuple[list[str], tuple[int, ...]] | None:
    """``(_tokens(text), ends)``, ``ends[i]`` the number of tokens up to the end of line ``i`` of
    ``text.splitlines()``; None for a text with an information separator (``\\x1c``-``\\x1f``: three
    of them end a line for ``splitlines`` and are no whitespace to the patterns, so a token can hold
    one). Every other line boundary (``\\n``, ``\\r``, ``\\x0b``, ``\\x0c``, ``\\x85``, ``\\u2028``,
    ``\\u2029``) is whitespace to every alternative and lookaround, so no token spans two lines and
    the tokens of any lines of the text, joined by newlines, are those lines' tokens (a test checks
    both on random and real text)."""
    if _SPLIT_ONLY_RE.search(text):
        return None
    get = _CHUNKS.__getitem__
    tokens: list[str] = []
    ends: list[int] = []
    for line in text.splitlines():
        tokens += chain.from_iterable(map(get, line.split()))
        ends.append(len(tokens))
    return tokens, tuple(ends)


_CJK_RE = regex.compile(rf"[{_CJK_CLASS}]")
_UNSPACED_CHAR = regex.compile(rf"[{_UNSPACED_CLASS}]")
_KANA_RE = regex.compile(r"[\p{Hiragana}\p{Katakana}]")
# A sentence ends at terminal punctuation followed by space/end; CJK full-width terminals end one anywhere.
# An ellipsis ("...") does not end a sentence; "end.Next" (lower, stop, upper) does, as spaCy splits it.
_SENT_END_RE = regex.compile(
    r"(?<!\.)(?!\.\.)[\p{Sentence_Terminal}]+[\"'”’»)\]」』）]*(?=\s|$)|[。！？｡]+[」』”）]*"
    r"|(?<=\p{Ll})[.!?](?=\p{Lu})")


def _sent_end_ascii() -> re.Pattern[str]:
    r"""``_SENT_END_RE`` for ASCII text, on the standard ``re`` module (no Unicode property to test per
    character): the same alternatives, each class reduced to its ASCII members (the full-width
    terminals have none); a test compares the matches on random ASCII text.

    Every match starts at a terminal (``.``, ``!`` or ``?``), so the pattern starts with one, and the
    assertions made before it move after it, reading one character further back: the engine then
    jumps from terminal to terminal instead of testing the assertions at every character (~3x
    faster). ``(?<!\.)(?!\.\.)`` before the terminal is ``(?<!\.[term])(?!(?<=\.)\.)`` after it;
    ``(?<=[a-z])`` before it is ``(?<=[a-z][.!?])`` after."""
    term, close = _ascii_class(r"\p{Sentence_Terminal}"), _ascii_class(r"[\"'”’»)\]」』）]")
    space, lower, upper = _ascii_class(r"\s"), _ascii_class(r"\p{Ll}"), _ascii_class(r"\p{Lu}")
    assert set(term.replace("\\", "")) == set("!.?")  # the third alternative's [.!?] is the same class
    return re.compile(rf"[{term}](?:(?<!\.[{term}])(?!(?<=\.)\.)[{term}]*[{close}]*(?=[{space}]|$)"
                      rf"|(?<=[{lower}][{term}])(?=[{upper}]))")


_SENT_END_ASCII = _sent_end_ascii()


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


# Sudachi refuses inputs over 49,149 UTF-8 bytes; a CJK character takes at most 4.
_SEGMENT_CHARS = 12_000
_local = threading.local()


# The segmenters' import names and the distributions that provide them (all llmpipe dependencies).
SEGMENTER_MODULES = {"sudachipy": "sudachipy", "sudachidict_core": "sudachidict-core", "rjieba": "rjieba",
                     "icu": "pyicu-wheels"}


def check_segmenters() -> None:
    """Fail fast (in the stage's parent, before any shard runs) when a word segmenter is not installed;
    otherwise every Japanese or Chinese document would be quarantined one by one."""
    missing = [dist for mod, dist in SEGMENTER_MODULES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError(f"word segmentation (CJK, Thai, Lao, Khmer, Burmese) needs the packages {', '.join(missing)} "
                           "(llmpipe dependencies: reinstall llmpipe, e.g. `pip install -e .`)")


@lru_cache(maxsize=1)
def _sudachi_dictionary() -> Any:
    from sudachipy import Dictionary

    return Dictionary(dict="core")  # the sudachidict_core wheel: no download


def _segment_ja(run: str) -> list[str]:
    tok = getattr(_local, "sudachi", None)
    if tok is None:  # a Sudachi tokenizer must not be shared between threads; the dictionary can be
        from sudachipy import SplitMode

        tok = _local.sudachi = _sudachi_dictionary().tokenizer(mode=SplitMode.C, fields=set())
    return [w for m in tok.tokenize(run) if (w := m.surface())]


def _segment_zh(run: str) -> list[str]:
    import rjieba

    return rjieba.cut(run, hmm=True)


SEGMENTERS: dict[str, Callable[[str], list[str]]] = {"ja": _segment_ja, "zh": _segment_zh}


def _icu_words() -> Any:
    """ICU's word break iterator (one per thread: an iterator holds its text). The root locale: ICU
    picks the dictionary (Thai, Lao, Khmer, Burmese) by each character's script."""
    it = getattr(_local, "icu_words", None)
    if it is None:
        import icu  # pyicu-wheels: PyICU with ICU bundled

        it = _local.icu_words = icu.BreakIterator.createWordInstance(icu.Locale.getRoot())
    return it


def segment_sea(runs: list[str]) -> list[list[str]]:
    """Words of each run of Thai / Lao / Khmer / Myanmar characters, all runs in one ICU pass (joined by
    newlines, where ICU always breaks). Every character of these scripts is in the BMP, so ICU's UTF-16
    offsets are Python string offsets."""
    if not runs:
        return []
    text = "\n".join(runs)
    it = _icu_words()
    it.setText(text)
    groups: list[list[str]] = [[]]
    start = it.first()
    for end in it:
        piece, start = text[start:end], end
        if piece == "\n":
            groups.append([])
        elif piece:
            groups[-1].append(piece)
    if len(groups) != len(runs) or any("".join(g) != r for g, r in zip(groups, runs, strict=True)):
        raise RuntimeError("ICU word segmentation did not cover its input")  # never seen: fail loudly
    return groups


def segmenter_lang(text: str, lang: str | None) -> str:
    """Which segmenter a document's CJK runs get: ``ja`` for Japanese, ``zh`` for the Chinese languages;
    for any other (or no) language tag, ``ja`` when the text has kana, else ``zh``."""
    base = (lang or "").split("_")[0]
    if base == "ja":
        return "ja"
    if base in CJK_LANGS:
        return "zh"
    return "ja" if _KANA_RE.search(text, 0, 4000) else "zh"


def segment_cjk(run: str, lang: str) -> list[str]:
    """Words of a run of Han/kana characters (``lang``: ``ja`` or ``zh``, see :func:`segmenter_lang`)."""
    seg = SEGMENTERS[lang]
    if len(run) <= _SEGMENT_CHARS:
        return seg(run)
    return [w for i in range(0, len(run), _SEGMENT_CHARS) for w in seg(run[i : i + _SEGMENT_CHARS])]


def segment_runs(runs: list[str], lang: str) -> list[list[str]]:
    """Words of each run, segmenting many runs per call: a document has one run per clause, and a
    segmenter call costs ~50 us however short its input. Runs are joined by newlines, which both
    segmenters return as tokens of their own and no word crosses; a group that does not add up to
    its run (never seen) is segmented alone."""
    out: list[list[str]] = []
    i = 0
    while i < len(runs):
        if len(runs[i]) > _SEGMENT_CHARS // 2:
            out.append(segment_cjk(runs[i], lang))
            i += 1
            continue
        j, size = i, 0
        while j < len(runs) and len(runs[j]) <= _SEGMENT_CHARS // 2 and size + len(runs[j]) < _SEGMENT_CHARS:
            size += len(runs[j]) + 1
            j += 1
        groups: list[list[str]] = [[]]
        for w in SEGMENTERS[lang]("\n".join(runs[i:j])):
            if w == "\n":
                groups.append([])
            else:
                groups[-1].append(w)
        if len(groups) != j - i or any("".join(g) != r for g, r in zip(groups, runs[i:j], strict=True)):
            groups = [segment_cjk(r, lang) for r in runs[i:j]]
        out.extend(groups)
        i = j
    return out


class DocWords(NamedTuple):
    """A document's words, split once for every filter that counts them (see :func:`doc_words`)."""

    words: tuple[str, ...]
    # ``line_ends[i]``: the number of words up to the end of line ``i`` of ``text.splitlines()``, so
    # line ``i``'s words are ``words[line_ends[i - 1]:line_ends[i]]``; None where the words of lines
    # are not their share of the document's (see :func:`doc_words`)
    line_ends: tuple[int, ...] | None

    def line(self, i: int) -> tuple[str, ...]:
        """The words of line ``i`` (``line_ends`` must not be None)."""
        assert self.line_ends is not None
        return self.words[self.line_ends[i - 1] if i else 0 : self.line_ends[i]]


def _doc_words(text: str, lang: str | None) -> DocWords:
    """:class:`DocWords` of a text: by lines where no character of an unspaced script (segmented by
    runs, with the whole text choosing the segmenter) or information separator is in it."""
    if has_unspaced(text):
        return DocWords(words_of(text, lang), None)
    split = _line_tokens(text)
    if split is None:
        return DocWords(tuple(_tokens(text)), None)
    return DocWords(tuple(split[0]), split[1])


class _WordsCache:
    """The words of the last documents split, bounded by their characters (thread-safe LRU).

    A filter stage runs each filter over a whole batch (1,024 documents) before the next, so the
    quality filters that count words ask for a document's words a batch apart: an 8-entry cache
    split a document that passed Gopher quality twice more (a third of the stage's word splitting
    on real text). Bounded by characters, not entries, so a batch of huge documents cannot hold
    gigabytes of word strings."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self.entries: OrderedDict[tuple[str, str | None], DocWords] = OrderedDict()
        self.lock = threading.Lock()

    def peek(self, text: str, lang: str | None) -> DocWords | None:
        """The cached entry, or None (nothing computed)."""
        key = (text, lang)
        with self.lock:
            found = self.entries.get(key)
            if found is not None:
                self.entries.move_to_end(key)
            return found

    def get(self, text: str, lang: str | None) -> DocWords:
        found = self.peek(text, lang)
        if found is not None:
            return found
        found = _doc_words(text, lang)
        self.put(text, lang, found)
        return found

    def put(self, text: str, lang: str | None, entry: DocWords) -> None:
        if len(text) > self.max_chars // 4:
            return
        key = (text, lang)
        with self.lock:
            if key not in self.entries:
                self.entries[key] = entry
                self.chars += len(text)
                while self.chars > self.max_chars:
                    (old, _), _ = self.entries.popitem(last=False)
                    self.chars -= len(old)


# ~3 batches of 1.3k-character documents (a batch's texts, and C4's rewrites of them); ~50 MB of words
_WORDS = _WordsCache(max_chars=4_000_000)


def split_words(text: str, lang: str | None = None) -> tuple[str, ...]:
    """Words of a document, ``lang`` being its language tag (or None); see :func:`words_of`.
    Cached (:class:`_WordsCache`): several filters ask for the same document (with the same ``lang``)."""
    return _WORDS.get(text, lang).words


def doc_words(text: str, lang: str | None = None) -> DocWords:
    """:func:`split_words` with where each line's words are (``line_ends``), cached with it. The line
    ends are there (not None) for a text with no character of an unspaced script and no information
    separator (``\\x1c``-``\\x1f``): no word spans two lines (see ``_line_tokens``), so the words of
    some of its lines, joined by newlines, are those lines' words in order. A text cached by
    :func:`remember_words` (a C4 rewrite) comes back without line ends: callers then split its lines."""
    return _WORDS.get(text, lang)


def cached_doc_words(text: str, lang: str | None = None) -> DocWords | None:
    """:func:`doc_words` where a filter before split the text, else None (nothing is computed)."""
    return _WORDS.peek(text, lang)


def remember_words(text: str, lang: str | None, words: tuple[str, ...]) -> None:
    """Cache ``words`` as the words of ``text`` (which must be ``split_words(text, lang)``): for a
    filter that rewrites a document from lines whose words it has (C4 drops lines), so the filters
    after it do not split the new text again. Its lines' ends are not kept (``line_ends`` None)."""
    _WORDS.put(text, lang, DocWords(words, None))


def cjk_runs(text: str) -> list[str]:
    """The runs of Han/kana characters in ``text``, in order: what :func:`words_of` segments."""
    return [t for t in _tokens(text) if _CJK_RE.match(t)]


def words_of(text: str, lang: str | None = None) -> tuple[str, ...]:
    """Words of ``text`` (uncached: for many small pieces such as lines). Spaced scripts split on the
    regex; runs of CJK characters are segmented into words by the segmenter :func:`segmenter_lang`
    picks for ``text`` and ``lang``, runs of Thai, Lao, Khmer and Myanmar by ICU."""
    tokens = _tokens(text)
    if not has_unspaced(text):  # no unspaced character: no run to segment
        return tuple(tokens)
    runs = [t for t in tokens if _UNSPACED_CHAR.match(t)]
    if not runs:
        return tuple(tokens)
    cjk = [t for t in runs if _CJK_RE.match(t)]
    sea = [t for t in runs if not _CJK_RE.match(t)]
    cjk_words = iter(segment_runs(cjk, segmenter_lang(text, lang)) if cjk else [])
    sea_words = iter(segment_sea(sea))
    words: list[str] = []
    for t in tokens:
        if not _UNSPACED_CHAR.match(t):
            words.append(t)
        elif _CJK_RE.match(t):
            words.extend(next(cjk_words))
        else:
            words.extend(next(sea_words))
    return tuple(words)


def _non_space(text: str) -> int:
    """Characters of ``text`` for which ``str.isspace`` is false: ``str.split()`` cuts at exactly
    those whitespace characters, in C (a per-character generator cost ~40% of the quality stage)."""
    return sum(map(len, text.split()))


def cjk_ratio(text: str, sample: int = 4000) -> float:
    """Share of non-space characters that are CJK (on a prefix sample, to stay O(1) on huge docs)."""
    head = text[:sample]
    if not has_unspaced(head):  # no CJK character: 0.0 without counting
        return 0.0
    non_space = _non_space(head)
    return len(_CJK_RE.findall(head)) / non_space if non_space else 0.0


def is_cjk_doc(text: str, lang: str | None) -> bool:
    """A Chinese / Japanese document: by its language tag, else by its characters."""
    if lang:
        return lang.split("_")[0] in CJK_LANGS
    return cjk_ratio(text) > 0.3


def unspaced_ratio(text: str, sample: int = 4000) -> float:
    """Share of non-space characters from scripts written without spaces (on a prefix sample)."""
    head = text[:sample]
    if not has_unspaced(head):  # no unspaced character: 0.0 without counting
        return 0.0
    non_space = _non_space(head)
    return len(_UNSPACED_CHAR.findall(head)) / non_space if non_space else 0.0


_SEA_SCRIPT_LANGS = (("th", regex.compile(r"\p{Thai}")), ("lo", regex.compile(r"\p{Lao}")),
                     ("km", regex.compile(r"\p{Khmer}")), ("my", regex.compile(r"\p{Myanmar}")))


def unspaced_lang(text: str, sample: int = 4000) -> str:
    """The language of an untagged unspaced document by its script: ``ja`` / ``zh`` for CJK (see
    :func:`segmenter_lang`), else the Thai / Lao / Khmer / Myanmar script it holds most of."""
    head = text[:sample]
    counts = [(len(rx.findall(head)), lang) for lang, rx in _SEA_SCRIPT_LANGS]
    best = max(counts)
    if best[0] > len(_CJK_RE.findall(head)):
        return best[1]
    return segmenter_lang(text, None)


def is_unspaced_doc(text: str, lang: str | None) -> bool:
    """A document written without spaces between words (CJK, Thai, Lao, Khmer, Burmese): by its
    language tag, else by its characters. Word-length bounds made for spaced scripts do not apply
    to it, and its words touch (no space between them in an n-gram's characters)."""
    if lang:
        return lang.split("_")[0].split("-")[0].lower() in UNSPACED_LANGS
    return unspaced_ratio(text) > 0.3


def count_sentences(text: str) -> int:
    """Sentences in ``text``: runs of sentence-terminal punctuation ending a clause, plus a trailing rest."""
    ends = list((_SENT_END_ASCII if text.isascii() else _SENT_END_RE).finditer(text))
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
