"""Quality filters: every reason code is hit by a hand-written document, and good text passes."""

from __future__ import annotations

import pytest

from llmpipe.curation.config import (
    C4Settings,
    FineWebSettings,
    GopherQualitySettings,
    GopherRepetitionSettings,
)
from llmpipe.curation.quality import (
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
)
from tests.fixtures.curation_docs import GOOD_EN, doc

ZH = ("今天的天气很好，我们在公园里散步。孩子们在草地上玩耍，老人们在树下下棋。"
      "中午我们找了一家小饭馆吃饭，菜的味道很不错。下午我们去了博物馆，看了很多有意思的展品。"
      "晚上回家以后，大家都觉得这一天过得很充实。")
JA = ("駅前の小さな喫茶店は、朝七時から営業しています。店主が一杯ずつ丁寧にいれるコーヒーが評判で、"
      "出勤前の会社員や近所のお年寄りが毎朝のように訪れます。窓際の席からは商店街の様子がよく見えます。"
      "週末には手作りのケーキも並び、午後になると売り切れることもあります。"
      "店主は毎日新しい豆を選び、季節ごとに違う味を楽しめるように工夫しています。")


def test_good_english_passes_every_filter() -> None:
    for f in (GopherQualityFilter(), GopherRepetitionFilter(), C4QualityFilter(), FineWebQualityFilter()):
        assert f.filter(doc(GOOD_EN)) is True, f.name


@pytest.mark.parametrize("text", [ZH, JA])
def test_cjk_is_not_too_short_and_passes_gopher(text: str) -> None:
    lang = "zh" if text is ZH else "ja"
    d = doc(text, lang=lang)
    assert GopherQualityFilter().filter(d) is True
    sc = d.metadata["scores"]["gopher_quality"]
    assert sc["cjk"] and sc["n_words"] >= 50  # segmented words (Sudachi / jieba), not spaces
    assert GopherRepetitionFilter().filter(doc(text, lang=lang)) is True
    assert C4QualityFilter().filter(doc(text, lang=lang)) is True  # CJK terminals end sentences
    assert FineWebQualityFilter().filter(doc(text, lang=lang)) is True
    # without a lang tag the script decides
    assert GopherQualityFilter().filter(doc(text)) is True


WORDS = "the people and the children walked with their friends to that market today".split()


def words(n: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n))


GQ_CASES = {
    "gopher_short_doc": (words(20) + ".", {}),
    "gopher_long_doc": (words(300) + ".", {"max_doc_words": 200}),
    "gopher_below_avg_word_length": ("a b c d e f the and of to " * 10, {}),
    "gopher_above_avg_word_length": ("the and " + "incomprehensibilities " * 60, {}),
    "gopher_too_many_hashes": (words(60) + " #a" * 10, {}),
    "gopher_too_many_ellipsis": (words(60) + " more..." * 10, {}),
    "gopher_too_many_bullets": ("\n".join("- " + words(8) for _ in range(10)), {}),
    "gopher_too_many_end_ellipsis": ("\n".join(words(10) + "..." for _ in range(6)) + "\n" + words(10),
                                     {"max_symbol_word_ratio": None}),
    "gopher_below_alpha_threshold": (words(60) + " 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18", {}),
    "gopher_not_enough_stop_words": ("lorem market river window " * 20, {}),
}


@pytest.mark.parametrize("reason", sorted(GQ_CASES))
def test_gopher_quality_reasons(reason: str) -> None:
    text, overrides = GQ_CASES[reason]
    f = GopherQualityFilter(GopherQualitySettings(**overrides))
    assert f.filter(doc(text)) == (False, reason)


def test_gopher_stop_words_are_per_language() -> None:
    de = ("Die Stadt und der Fluss sind im Sommer sehr schön, und es gibt viele Gäste aus dem Ausland. " * 6)
    assert GopherQualityFilter().filter(doc(de, lang="de")) is True
    # English stop words on German text: rejected only when the doc claims to be English
    assert GopherQualityFilter().filter(doc(de, lang="en")) == (False, "gopher_not_enough_stop_words")


SENT = [f"Sentence number {i} talks about a different topic entirely." for i in range(40)]
REP_CASES = {
    "dup_para_frac": ("\n\n".join(["Same paragraph here."] * 3 + SENT[:3]),
                      {}),
    "dup_para_char_frac": ("\n\n".join([SENT[0] * 4] * 2 + SENT[1:6]), {"dup_para_frac": None}),
    "dup_line_frac": ("\n".join(["ok."] * 5 + SENT[:6]), {"dup_para_frac": None, "dup_para_char_frac": None,
                                                          "top_n_grams": {}, "dup_n_grams": {}}),
    "dup_line_char_frac": ("\n".join([SENT[0] * 3] * 2 + SENT[1:8]),
                           {"dup_para_frac": None, "dup_para_char_frac": None, "dup_line_frac": None}),
    "top_2_gram": ("blue whale " * 30 + " ".join(SENT[:3]), {}),
    "top_3_gram": ("big blue whale " * 20 + " ".join(SENT[:6]), {"top_n_grams": {2: 1.0, 3: 0.18}}),
    "top_4_gram": ("a big blue whale " * 20 + " ".join(SENT[:8]), {"top_n_grams": {2: 1.0, 3: 1.0, 4: 0.16}}),
}
for _n in range(5, 11):
    _grams = {m: 1.0 for m in range(5, _n)}
    REP_CASES[f"duplicated_{_n}_n_grams"] = (
        " ".join(SENT[:12]) + " " + " ".join(SENT[:3]),
        {"top_n_grams": {}, "dup_n_grams": {**_grams, _n: 0.1}},
    )


@pytest.mark.parametrize("reason", sorted(REP_CASES))
def test_gopher_repetition_reasons(reason: str) -> None:
    text, overrides = REP_CASES[reason]
    f = GopherRepetitionFilter(GopherRepetitionSettings(**overrides))
    assert f.filter(doc(text)) == (False, reason)


def test_dup_ngram_matches_reference_definition() -> None:
    # "a b c d e" repeated: the scan skips past each repeat, counting its characters once
    text = "a b c d e a b c d e x"
    d = doc(text)
    GopherRepetitionFilter(GopherRepetitionSettings(top_n_grams={}, dup_n_grams={5: 1.0})).filter(d)
    assert d.metadata["scores"]["gopher_repetition"]["dup_n_gram_char_frac"]["5"] == pytest.approx(5 / len(text))


def _dup_chars_scan(words: list[str], n: int) -> int:
    """Gopher's duplicate n-gram scan as written: every position, left to right, skipping each repeat."""
    seen: set[tuple[str, ...]] = set()
    total, i = 0, 0
    while i < len(words) - n + 1:
        gram = tuple(words[i : i + n])
        if gram in seen:
            total += sum(map(len, gram))
            i += n
        else:
            seen.add(gram)
            i += 1
    return total


def _top_chars_direct(words: list[str], n: int, sep: int) -> int:
    """The most frequent n-gram's characters times its count, ties to the first seen, by brute force."""
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    best = max(grams.count(g) for g in grams)
    first = next(g for g in grams if grams.count(g) == best)
    return (sum(map(len, first)) + (n - 1) * sep) * best


def test_ngram_figures_of_the_shortcuts_equal_gophers_scan() -> None:
    """The duplicate scan and the top n-gram restricted to repeated n-grams, each size to the previous
    size's repeats (top and duplicate sizes in one chain), give the figures of the plain definitions
    (random word sequences over small vocabularies: overlapping repeats, repeats inside skipped
    spans, ties, sizes past the document's length)."""
    import random

    from llmpipe.curation.quality import _ngram_chars

    rng = random.Random(3)
    for _ in range(3000):
        vocab = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 12))]
        words = tuple(rng.choice(vocab) for _ in range(rng.randint(1, 60)))
        top_sizes = set(rng.sample(range(1, 11), rng.randint(0, 4)))
        dup_sizes = set(rng.sample(range(1, 11), rng.randint(0, 5)))
        sep = rng.randint(0, 1)
        top, dup = _ngram_chars(words, top_sizes, dup_sizes, sep)
        assert dup == {n: _dup_chars_scan(list(words), n) for n in dup_sizes if n <= len(words)}, words
        assert top == {n: _top_chars_direct(list(words), n, sep) for n in top_sizes if n <= len(words)}, words
    text = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3
    d = doc(text)
    GopherRepetitionFilter().filter(d)
    direct = {str(n): _dup_chars_scan(text.split(), n) / len(text) for n in range(5, 11)}
    assert d.metadata["scores"]["gopher_repetition"]["dup_n_gram_char_frac"] == pytest.approx(direct)


C4_CASES = {
    "lorem_ipsum": GOOD_EN + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "curly_bracket": GOOD_EN + "\nThe function body is { return x; } in this example text.",
    "too_few_sentences": "One sentence here is fine.\nAnother one ends well.\nnot ended\nshort.",
}


@pytest.mark.parametrize("reason", sorted(C4_CASES))
def test_c4_reasons(reason: str) -> None:
    assert C4QualityFilter().filter(doc(C4_CASES[reason])) == (False, reason)


def test_c4_removes_failing_lines_and_counts_them() -> None:
    text = GOOD_EN + ("\nPlease enable Javascript to view this page properly.\nRead our privacy policy here today."
                      "\nNo terminal punctuation here\nToo short.\nSee the note [1] and [citation needed].")
    d = doc(text)
    assert C4QualityFilter().filter(d) is True
    sc = d.metadata["scores"]["c4"]
    assert sc["lines_dropped"] == {"javascript": 1, "policy": 1, "no_terminal_punct": 1, "too_few_words": 1}
    assert "Javascript" not in d.text and "privacy" not in d.text and "[1]" not in d.text
    assert d.text.startswith(GOOD_EN.split("\n")[0])
    keep_text = C4QualityFilter(C4Settings(remove_lines=False))
    d2 = doc(text)
    assert keep_text.filter(d2) is True and d2.text == text


def test_c4_hands_its_rewritten_text_the_words_of_its_kept_lines() -> None:
    """C4 drops lines; the words of its new text come from the kept lines' words of the document that
    Gopher quality split (a line that lost a citation is split again), so FineWeb does not split the
    text twice: on random documents of good, failing, cited and accented lines with every kind of line
    break, each equals a fresh split of the new text."""
    import random

    from llmpipe.curation.text import cached_doc_words, words_of

    rng = random.Random(5)
    lines = [*GOOD_EN.split("\n"), "See the note [1] and [citation needed] here.", "Its value was 3[2].5 in 1,000 runs.",
             "The café’s “naïve” owner didn’t agree, she said.", "No terminal punctuation here",
             "Please enable Javascript to view this page.", "Too short.", "[edit] The list ends here today.",
             "Mail a.b@c.org or see https://x.org/a. for the rest.", "  ", ""]
    breaks = ["\n", "\r\n", "\n\n", "\u2028", "\x85", "\r"]
    rewritten = 0
    for _ in range(400):
        text = "".join(rng.choice(lines) + rng.choice(breaks) for _ in range(rng.randint(1, 10)))
        d = doc(text, lang="en")
        GopherQualityFilter().scores(d)  # splits the document (and caches its words by line)
        if C4QualityFilter().filter(d) is not True or d.text == text:
            continue
        rewritten += 1
        cached = cached_doc_words(d.text, "en")
        assert cached is not None and cached.words == words_of(d.text, "en"), repr(text)
        assert FineWebQualityFilter().scores(d)["list_ratio"] == d.text.count("\n") / max(len(words_of(d.text)), 1)
    assert rewritten > 100


def test_c4_word_rules_count_whitespace_words_as_defined() -> None:
    """C4 splits a line only as far as its rules need (no word is longer than its line; the word count
    only below ``min_words_per_line``): the lines dropped for long words and for too few words are
    those of the plain definition, ``line.split()``, on random lines and settings."""
    import random

    rng = random.Random(9)
    for _ in range(300):
        max_len, min_words = rng.choice([-1, 0, 3, 8, 40]), rng.choice([-1, 0, 1, 3, 5])
        lines = [" ".join("x" * rng.randint(1, 12) for _ in range(rng.randint(0, 7))) + rng.choice([".", "", "!"])
                 for _ in range(rng.randint(1, 8))]
        f = C4QualityFilter(C4Settings(max_word_length=max_len, min_words_per_line=min_words, min_num_sentences=-1))
        want: dict[str, int] = {}
        for line in "\n".join(lines).splitlines():
            words = line.strip().split()
            if max_len != -1 and words and max(map(len, words)) > max_len:
                want["too_long_word"] = want.get("too_long_word", 0) + 1
            elif not line.strip().endswith((".", "!")):
                want["no_terminal_punct"] = want.get("no_terminal_punct", 0) + 1
            elif len(words) < min_words:
                want["too_few_words"] = want.get("too_few_words", 0) + 1
        assert f.scores(doc("\n".join(lines)))["lines_dropped"] == want, (lines, max_len, min_words)


FW_CASES = {
    "empty": ("  \n \n", {}),
    "line_punct_ratio": ("\n".join(f"a long line without punctuation number {i} here" for i in range(10)), {}),
    "short_line_ratio": ("\n".join([f"Tiny {i}." for i in range(12)] + [GOOD_EN]), {}),
    "char_dup_ratio": (GOOD_EN + "\n" + GOOD_EN.split("\n")[0], {}),
    "list_ratio": ("\n".join(f"No{i}." for i in range(10)), {"short_line_thr": None}),
}


@pytest.mark.parametrize("reason", sorted(FW_CASES))
def test_fineweb_reasons(reason: str) -> None:
    text, overrides = FW_CASES[reason]
    assert FineWebQualityFilter(FineWebSettings(**overrides)).filter(doc(text)) == (False, reason)


def test_word_kind_shortcut_for_ascii_letters_and_digits_equals_the_general_rule() -> None:
    """ASCII words of letters and digits skip the per-character symbol test: the same packed terms."""
    import random

    from llmpipe.curation.quality import _ALPHA, _FIELD, _word_kind
    from llmpipe.curation.text import is_symbol_word

    def general(w: str) -> int:
        non_symbol = not is_symbol_word(w)
        return int(_ALPHA.search(w) is not None) | int(non_symbol) << _FIELD | (len(w) if non_symbol else 0) << 2 * _FIELD

    rng = random.Random(5)
    words = ["a", "Z", "0", "42", "x1", "1x", "_", "a_b", "²", "é", "...", "-", "3.5", "it's", "ǅ", "\x00"]
    words += ["".join(rng.choice("aZ09_.-é²'") for _ in range(rng.randint(1, 6))) for _ in range(3000)]
    for w in words:
        assert _word_kind(w) == general(w), w


def test_c4_policy_phrases_without_cookie_are_the_two_searched_first() -> None:
    """C4 searches a line for the policy phrases with "cookie" only when it holds "cookie"."""
    from llmpipe.curation.quality import _POLICY

    assert sorted(p for p in _POLICY if "cookie" not in p) == ["privacy policy", "terms of use"]
    for phrase in _POLICY:
        d = doc(GOOD_EN + f"\nThis page is about the {phrase} of the site, as you know.", lang="en")
        assert C4QualityFilter().filter(d) is True and d.metadata["scores"]["c4"]["lines_dropped"] == {"policy": 1}
