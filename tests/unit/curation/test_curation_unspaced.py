"""Scripts written without spaces beyond CJK: Thai, Lao, Khmer and Burmese are segmented into words (ICU),
share one definition across quality, safety and dedup, and a Thai paragraph is judged on its words."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest

from llmpipe.curation.config import GopherQualitySettings
from llmpipe.curation.quality import GopherQualityFilter, GopherRepetitionFilter
from llmpipe.curation.safety import compile_blocklist
from llmpipe.curation.text import (
    UNSPACED_LANGS,
    UNSPACED_RANGES,
    UNSPACED_RE,
    is_unspaced_doc,
    unspaced_lang,
    words_of,
)
from tests.fixtures.curation_docs import doc

# A family trip to the sea: nine sentences, spaces only between phrases (as Thai is written).
THAI = ("เมื่อวานนี้ครอบครัวของเราเดินทางไปเที่ยวทะเลที่จังหวัดชลบุรี เราออกจากบ้านตั้งแต่เช้าเพราะอยากหลีกเลี่ยงรถติด "
        "ระหว่างทางเราแวะกินข้าวเช้าที่ร้านเล็กๆ ริมถนน อาหารอร่อยและราคาไม่แพง "
        "เมื่อถึงชายหาดเด็กๆ รีบวิ่งลงไปเล่นน้ำทันที ส่วนผู้ใหญ่นั่งพักผ่อนใต้ร่มไม้และคุยกันอย่างสนุกสนาน "
        "ตอนบ่ายเราไปเดินตลาดปลาเพื่อซื้ออาหารทะเลสดกลับบ้าน ก่อนกลับเราได้ชมพระอาทิตย์ตกที่สวยงามมาก "
        "ทุกคนเห็นตรงกันว่าเป็นวันที่มีความสุขที่สุดวันหนึ่งของปีนี้")
LAO = "ພາສາລາວເປັນພາສາທີ່ໃຊ້ໃນປະເທດລາວ"
KHMER = "ភាសាខ្មែរគឺជាភាសាកំណើតរបស់ជនជាតិខ្មែរ"
BURMESE = "မြန်မာဘာသာစကားသည် မြန်မာနိုင်ငံ၏ ရုံးသုံးဘာသာစကား ဖြစ်သည်။"


def test_thai_lao_khmer_burmese_runs_become_words() -> None:
    assert words_of(THAI)[:6] == ("เมื่อ", "วาน", "นี้", "ครอบครัว", "ของ", "เรา")  # ICU's dictionary cuts
    assert len(THAI.split()) == 11 and len(words_of(THAI)) > 80  # phrases were counted as words
    for text, at_least in ((LAO, 6), (KHMER, 5), (BURMESE, 6)):
        words = words_of(text)
        assert len(words) >= at_least and "".join(words) == text.replace(" ", ""), text
    mixed = words_of("ภาษาไทย and English 日本語です")
    assert mixed == ("ภาษา", "ไทย", "and", "English", "日本語", "です")


@pytest.mark.parametrize("tag", ["th", None])
def test_a_thai_paragraph_is_not_a_short_doc(tag: str | None) -> None:
    """18 space-separated phrases of ~58 characters each were 18 'words': gopher_short_doc."""
    d = doc(THAI, lang=tag) if tag else doc(THAI)
    f = GopherQualityFilter()
    assert f.filter(d) is True
    sc = d.metadata["scores"]["gopher_quality"]
    assert sc["cjk"] is True and sc["n_words"] >= GopherQualitySettings().min_doc_words
    assert sc["lang"] == "th"  # untagged: by its script
    assert GopherRepetitionFilter().filter(doc(THAI, lang="th")) is True


def test_one_definition_of_unspaced_scripts() -> None:
    assert {"zh", "ja", "th", "lo", "km", "my"} <= UNSPACED_LANGS
    for text in (THAI, LAO, KHMER, BURMESE, "今日は良い天気です", "今天天气很好"):
        assert is_unspaced_doc(text, None) and UNSPACED_RE.search(text), text
    assert not is_unspaced_doc("A plain English sentence about the weather.", None)
    assert [unspaced_lang(t) for t in (THAI, LAO, KHMER, BURMESE, "今日は良い天気です")] == ["th", "lo", "km", "my", "ja"]
    assert isinstance(UNSPACED_RE, re.Pattern) and not UNSPACED_RE.search("Plain text, ça va? Привет!")
    # safety's blocklist matches inside unspaced text (no word boundaries there), word-bounded elsewhere
    assert compile_blocklist(["ทะเล"], "th").search(THAI) is not None
    assert compile_blocklist(["ass"], "en").search("a class act") is None


def test_stop_words_count_distinct_words_as_datatrove_does() -> None:
    """datatrove 0.10: ``len(stop_words & set(words)) < min_stop_words``; repeating "the" is one."""
    f = GopherQualityFilter(GopherQualitySettings(min_doc_words=5, min_avg_word_length=2))
    one = doc("the cat sat on the mat and the dog saw the cat " * 3, lang="en")
    res = f.filter(one)
    assert one.metadata["scores"]["gopher_quality"]["n_stop_words"] == 2  # "the", "and"
    assert res is True
    only_the = doc("the cat the mat the dog the sun the sky the sea " * 3, lang="en")
    assert f.filter(only_the) == (False, "gopher_not_enough_stop_words")
    assert only_the.metadata["scores"]["gopher_quality"]["n_stop_words"] == 1


def test_the_fast_word_pattern_is_taken_only_where_it_finds_the_same_words() -> None:
    """Text without a Thai/Lao/Khmer/Myanmar character is split by a pattern that skips those scripts'
    properties; the blocks that choose it must hold every character of the four scripts."""
    import regex

    from llmpipe.curation import text as T

    sea = [c for c in map(chr, range(0x30000)) if regex.match(f"[{T._SEA_CLASS}]", c)]
    assert len(sea) > 500 and all(T._SEA_BLOCKS.match(c) for c in sea)
    for text in ("Plain ASCII, it's 3.5 words...", "Ünïcödé café 日本語の文 and Русский текст!"):
        assert T._WORD_RE_NO_SEA.findall(text) == T._WORD_RE.findall(text)


def test_the_ascii_word_pattern_finds_the_words_of_the_unicode_one() -> None:
    """ASCII text is split by a standard-``re`` pattern (faster); on every ASCII character, code-like
    and prose samples and random ASCII strings it finds exactly the tokens of ``_WORD_RE``."""
    import random

    from llmpipe.curation import text as T

    rng = random.Random(0)
    every = [chr(c) for c in range(128)]
    samples = ["".join(every), "it's 3.5 words... see https://x.org/a?b=1). Mail a.b+c@d-e.org!",
               "Parse a URL: <scheme>://<netloc>/<path>;<params>?<query>#<fragment>\n>>> f(x, y=2)\n\tdone."]
    samples += ["".join(rng.choice(every) if rng.random() < 0.5 else rng.choice("ab1 .,'-@:/htps\n")
                        for _ in range(rng.randint(0, 40))) for _ in range(5000)]
    for text in samples:
        assert T._WORD_RE_ASCII.findall(text) == T._WORD_RE.findall(text), repr(text)
        assert words_of(text) == tuple(T._WORD_RE.findall(text))


def test_the_written_out_ranges_hold_every_character_of_the_unspaced_scripts() -> None:
    """``UNSPACED_RANGES`` (for the standard ``re`` module) covers what the ``regex`` module's script
    properties say today; a Unicode update that adds characters fails here, naming them."""
    from llmpipe.curation.text import _UNSPACED_CLASS, _script_ranges

    missing = [(hex(a), hex(b)) for a, b in _script_ranges(_UNSPACED_CLASS)
               if not any(lo <= a and b <= hi for lo, hi in UNSPACED_RANGES)]
    assert not missing, f"add these ranges to UNSPACED_RANGES: {missing}"


def test_the_patterns_without_links_find_the_same_words_where_no_link_can_be() -> None:
    """Text without ``://`` and ``@`` is split by patterns without the URL / e-mail alternatives (which
    cannot match there): the same tokens as ``_WORD_RE`` on ASCII, Unicode and Thai samples, and
    :func:`_tokens` picks the full patterns when a link can be there."""
    import random

    from llmpipe.curation import text as T

    rng = random.Random(1)
    alphabet = [*map(chr, range(128)), "é", "’", "日", "本", "ไ", "ท", "ย", "…", "\u3000", "Ж"]
    samples = ["it's 3.5 words... a.b+c at d-e.org, http x.org", "Ünïcödé café 日本語の文 and Русский текст!",
               "ภาษาไทย and English, e.g. 3.14"]
    samples += ["".join(rng.choice(alphabet) if rng.random() < 0.5 else rng.choice("ab1 .,'-:/htps\n")
                        for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    for text in samples:
        want = T._WORD_RE.findall(text)
        assert T._tokens(text) == want, repr(text)
        if "://" not in text and "@" not in text:
            assert T._WORD_RE_PLAIN.findall(text) == want, repr(text)
            if not T._SEA_BLOCKS.search(text):
                assert T._WORD_RE_NO_SEA_PLAIN.findall(text) == want, repr(text)
            if text.isascii():
                assert T._WORD_RE_ASCII_PLAIN.findall(text) == want, repr(text)
    assert T._tokens("mail a.b@c.org now") == ["mail", "a.b@c.org", "now"]
    assert T._tokens("see https://x.org/a now") == ["see", "https://x.org/a", "now"]


def test_the_word_run_written_for_speed_finds_the_words_of_its_definition() -> None:
    """The run of word characters is written ``char+(?:dot char*)*`` (and placed first) for speed; the
    tokens must be those of its definition, ``(?:char|dot)+`` after the unspaced runs and clitics, on
    text built to find the seams: dots and commas between letters, digits, CJK, marks and controls,
    clitics, links."""
    import random

    import regex

    from llmpipe.curation import text as T

    def defined(unspaced: str, links: bool) -> regex.Pattern[str]:
        head = r"https?://\S+?(?=[.,;:!?)\]\"']*(?:\s|$))|[\w.+-]+@[\w-]+(?:\.[\w-]+)+|" if links else ""
        return regex.compile(
            head + rf"[{T._CJK_CLASS}]+|[{T._SEA_CLASS}]+|(?<=\p{{L}})['’]\p{{L}}+"
            rf"|(?:[^\s{unspaced}\p{{P}}\p{{S}}]|(?<=[\p{{L}}\p{{N}}])[.,](?=[\p{{L}}\p{{N}}]))+|\.\.+|[^\s{unspaced}]")

    want_all, want_plain = defined(T._UNSPACED_CLASS, True), defined(T._UNSPACED_CLASS, False)
    rng = random.Random(2)
    alphabet = "aZ9.,.,'’ \n\x01\x1c\u0301é日本カไ٣…-@:/htps_"
    samples = ["it's 3.5 words, 1,000.5 a.b,c x.'y 日.本 a.日 ٣.٣ e\u0301.x", "see https://x.org/a.b, a.b@c.org."]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(20000)]
    for text in samples:
        want = want_all.findall(text)
        assert T._WORD_RE.findall(text) == want, repr(text)
        assert T._tokens(text) == want, repr(text)
        if "://" not in text and "@" not in text:
            assert T._WORD_RE_PLAIN.findall(text) == want_plain.findall(text) == want, repr(text)


def test_ascii_lines_of_a_unicode_text_are_split_as_the_whole_text_is() -> None:
    """A text with non-ASCII lines gives its ASCII lines to the ``re`` pattern: the same tokens as the
    Unicode pattern on the whole text, where lines meet URLs, e-mails, numbers and clitics."""
    import random

    from llmpipe.curation import text as T

    rng = random.Random(4)
    lines = ["it's 3.5 words,", "see https://x.org/a.", "mail a.b@c.org", "“Quoted” café, naïve.", "日本語の文。",
             "ภาษาไทย 3.14", "", "  ", "a.", ".b", "1,000", "’s", "...", "e\u0301.x", "end"]
    samples = ["\n".join(rng.choice(lines) for _ in range(rng.randint(1, 8))) for _ in range(3000)]
    for text in samples:
        assert T._tokens(text) == T._WORD_RE.findall(text), repr(text)


def test_unspaced_re_matches_exactly_the_written_out_ranges() -> None:
    """``UNSPACED_RE`` tests the ranges above U+FFFF only on such characters (for speed): on every
    code point it matches what one class of all the ranges matches."""
    every = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, 0x110000)))
    one_class = re.compile("[" + "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in UNSPACED_RANGES) + "]")
    assert all(b <= 0xFFFF or a > 0xFFFF for a, b in UNSPACED_RANGES)  # no range straddles the split
    assert UNSPACED_RE.findall(every) == one_class.findall(every)


def test_text_split_by_chunks_finds_the_pattern_tokens() -> None:
    """Text is split at whitespace and each chunk's tokens looked up (cached) by the fastest pattern for
    the chunk: the same tokens as ``_WORD_RE`` on the whole text, ASCII or not, with the information
    separators (whitespace to ``str.split`` only) sending the text to the pattern; the patterns'
    whitespace is ``str.split``'s less those four, on every code point."""
    import random

    import regex

    from llmpipe.curation import text as T

    assert T._ascii_class(r"\s") == re.escape("\t\n\x0b\x0c\r ")
    every = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    assert [c for c in every if c.isspace() != bool(regex.match(r"\s", c))] == list(T._SPLIT_ONLY_SPACE)
    rng = random.Random(6)
    alphabets = ("ab1.,'-@:/htps  \t\n\x0b\x0c\r\x1c\x1f_()",
                 "aé’1.,'-@:/htps \n\r\x85\u2028\u3000\xa0\x1e日本ไ\u0301…()")
    samples = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
               for alphabet in alphabets for _ in range(5000)]
    samples += ["see https://x.org/a.b, it's 3.5 (a.b@c.org)\n" * 3, "a" * 100 + " " + "a" * 100 + ".b",
                "“Quoted” café, naïve. don’t\nsee http://é.org/ü, ภาษาไทย 3.14"]
    for text in samples:
        want = T._WORD_RE.findall(text)
        assert T._tokens(text) == want, repr(text)
        assert T._tokens(text) == want, repr(text)  # from the cache


def _line_samples(seed: int, n: int) -> list[str]:
    """Random texts built to find a token that spans a line boundary: every character ``splitlines``
    ends a line at, next to URLs, e-mails, numbers, clitics, ellipses, citations and accents."""
    import random

    rng = random.Random(seed)
    pieces = ["it's", "3", ".", "5", ",", "a", "b", "’s", "...", "https://x.org/a", "a.b@c.org", "café", "e\u0301",
              "[1]", "[edit]", "—", "“", "”", "!", " ", " ", "\t", "\xa0", "\u3000", "x.", ".y", "1,000", "@", "://"]
    breaks = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\u2028", "\u2029", "\n\n", " \n "]
    return ["".join(rng.choice(breaks) if rng.random() < 0.15 else rng.choice(pieces)
                    for _ in range(rng.randint(0, 60))) for _ in range(n)]


def test_no_word_spans_two_lines() -> None:
    """Every line boundary but the information separators is whitespace to every alternative and
    lookaround of the word patterns, so a text's words are its lines' words in order, and any lines of
    it, stripped and joined by newlines, have exactly those lines' words (what lets C4's rewritten
    text reuse the words of the document it came from): on random text built to find the seams (the
    ASCII chunk path and the ``regex`` one) and on real prose of every sample language without an
    unspaced script."""
    import random

    from llmpipe.curation import text as T
    from llmpipe.data.multilingual import SAMPLES

    rng = random.Random(8)
    real = ["\n".join(paras) for lang, paras in sorted(SAMPLES.items()) if lang not in ("ja", "zh")]
    for text in _line_samples(7, 6000) + real:
        split = T._line_tokens(text)
        assert split is not None
        tokens, ends = split
        assert tokens == T._WORD_RE.findall(text), repr(text)
        lines = text.splitlines()
        assert len(ends) == len(lines)
        per_line = [T._WORD_RE.findall(line) for line in lines]
        assert [tokens[a:b] for a, b in pairwise((0, *ends))] == per_line, repr(text)
        some = sorted(rng.sample(range(len(lines)), rng.randint(0, len(lines))))
        joined = "\n".join(lines[i].strip() for i in some).strip()
        assert T._WORD_RE.findall(joined) == [w for i in some for w in per_line[i]], repr(text)
        d = T._doc_words(text, "en")  # not the cache: another test's C4 may have remembered this text
        assert d.words == words_of(text, "en") and [d.line(i) for i in range(len(lines))] == list(map(tuple, per_line))
    for sep in T._SPLIT_ONLY_SPACE:  # a token can hold one: no line ends, words of the whole text
        assert T._line_tokens(f"a{sep}b") is None and T.doc_words(f"a{sep}b c").line_ends is None
    assert T.doc_words("日本語の文章です。\nEnglish.").line_ends is None  # segmentation sees the whole text
    assert T.doc_words(THAI).line_ends is None


def test_ascii_sentence_ends_are_those_of_the_unicode_pattern() -> None:
    """Sentences of ASCII text are counted with a standard-``re`` pattern: the same matches as the
    ``regex`` one on random ASCII text built from terminals, closers, cases and whitespace."""
    import random

    from llmpipe.curation import text as T

    rng = random.Random(11)
    alphabet = "aZ.!?\"')] \t\n\x0b\x1c;:-1"
    samples = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(20000)]
    samples += ["It ends. Then... another!) 'Yes.' endNext. a.B", "".join(map(chr, range(128)))]
    for text in samples:
        assert [m.span() for m in T._SENT_END_ASCII.finditer(text)] == [m.span() for m in T._SENT_END_RE.finditer(text)], repr(text)


def test_the_quick_unspaced_check_is_the_written_out_ranges() -> None:
    """``has_unspaced`` first searches one class that holds every unspaced character (a superset, then
    confirmed): on every code point it answers what ``UNSPACED_RE`` does."""
    from llmpipe.curation import text as T

    every = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    assert all(T._MAYBE_UNSPACED_RE.match(c) for c in every if UNSPACED_RE.match(c))
    assert [c for c in every if T.has_unspaced(f"a’{c}")] == [c for c in every if UNSPACED_RE.match(c)]
