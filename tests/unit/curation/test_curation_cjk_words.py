"""Every language is first-class: CJK text is counted in words, so the quality rules treat it like the rest.

The keep-rate test runs the real langid model and the quality filters of ``configs/tiny.yaml`` over
the built-in multilingual sample; the unit tests pin the word notion (Sudachi for Japanese, jieba's
dictionary for Chinese) and check that repetitive CJK spam is still caught.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from llmpipe.config import load_config
from llmpipe.curation.config import C4Settings, GopherRepetitionSettings
from llmpipe.curation.filters import FilterChain
from llmpipe.curation.langid import LanguageFilter
from llmpipe.curation.quality import (
    C4QualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    build_quality_filters,
)
from llmpipe.curation.text import cjk_runs, segment_cjk, segment_runs, segmenter_lang, split_words
from llmpipe.data.builtin_corpus import multilingual_documents
from llmpipe.data.multilingual import SAMPLES
from llmpipe.document import Document
from tests.fixtures.curation_docs import doc

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
# Each language's quality keep rate on the built-in sample lies within this many percentage points
# (as a fraction) of English's. One document of a language is about 8 points of its rate.
KEEP_RATE_BAND = 0.15

# Ordinary manual-page prose whose terms repeat. Counted one word per character (the old notion),
# the Japanese one's duplicated 5-grams exceed Gopher's limit (test_per_character_counting_flags_it);
# the Chinese one was rejected as top_3_gram when each character counted as a word.
JA_MANUAL = ("ファイルをコピーするときは、コピー先のディレクトリを最初に指定します。ディレクトリが存在しない場合は、"
             "新しいディレクトリが作成されます。オプションを指定しない場合、既存のファイルは上書きされません。"
             "上書きしたい場合は、--forceオプションを指定してください。オプションは設定ファイルにも書くことができ、"
             "コマンドラインのオプションが設定ファイルより優先されます。"
             "ファイルの数が多い場合は、--verboseオプションでコピーの経過を確認できます。")
ZH_MANUAL = ("程序启动时会读取配置文件。配置文件的路径可以在命令行中指定，如果命令行中没有指定，程序会在当前目录中查找配置文件。"
             "配置文件中的每一行是一个设置项，设置项的名称和值之间用等号分隔。命令行中的设置项优先于配置文件中的设置项。"
             "修改配置文件以后，需要重新启动程序，新的设置项才会生效。")
JA_SPAM = "".join(f"【{i}】今すぐクリックして無料ボーナスをゲット！今すぐ登録して限定特典をゲット！" for i in range(8))
ZH_SPAM = "".join(f"第{i}期：点击这里免费领取大奖，立即注册即可领取现金红包，机会难得不要错过！" for i in range(8))
NGRAM_REASONS = {f"top_{n}_gram" for n in (2, 3, 4)} | {f"duplicated_{n}_n_grams" for n in range(5, 11)}


def _keep_rates() -> tuple[dict[str, float], dict[str, Counter[str]], Counter[str]]:
    """Per-language quality keep rates of the built-in sample, after the real langid (tiny config)."""
    cfg = load_config(TINY)
    docs = [Document(id=d["id"], text=d["text"], source="builtin", metadata={"hint": d["lang_hint"]})
            for d in multilingual_documents()]
    tagged, dropped = FilterChain([LanguageFilter(cfg.langid)]).run_batch(docs)
    assert not dropped, [(d.id, d.metadata["reject_reason"]) for d in dropped]
    assert all(d.metadata["lang"] == d.metadata["hint"] for d in tagged)
    kept, rejected = FilterChain(build_quality_filters(cfg.quality)).run_batch(tagged)
    total = Counter(d.metadata["hint"] for d in tagged)
    n_kept = Counter(d.metadata["hint"] for d in kept)
    reasons: dict[str, Counter[str]] = {lang: Counter() for lang in total}
    for d in rejected:
        reasons[d.metadata["hint"]][d.metadata["reject_reason"]] += 1
    return {lang: n_kept[lang] / n for lang, n in total.items()}, reasons, total


def test_keep_rate_of_every_language_is_within_band_of_english() -> None:
    rates, reasons, total = _keep_rates()
    assert set(rates) == {"en", "zh", "de", "fr", "ja", "ru", "es"}
    assert min(total.values()) >= 12, total  # enough documents for a rate to mean something
    assert rates["en"] >= 0.9, reasons["en"]
    off = {lang: (round(r, 2), dict(reasons[lang])) for lang, r in rates.items()
           if abs(r - rates["en"]) > KEEP_RATE_BAND}
    assert not off, f"keep rates outside en {rates['en']:.2f} +- {KEEP_RATE_BAND}: {off}"


def test_sample_has_the_same_manual_page_in_every_language() -> None:
    # the manual-page paragraphs are what exposed per-character n-grams; each language has them
    assert all(any("--timeout" in p for p in paras) for paras in SAMPLES.values())


def _per_char_dup_frac(text: str, n: int) -> float:
    """Gopher's duplicated n-gram character fraction with one word per non-space character."""
    toks = [c for c in text if not c.isspace()]
    grams = [tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)]
    seen: set[tuple[str, ...]] = set()
    dup, i = 0, 0
    while i < len(grams):
        if grams[i] in seen:
            dup, i = dup + n, i + n
        else:
            seen.add(grams[i])
            i += 1
    return dup / len(text)


def test_per_character_counting_flags_it() -> None:
    # what the Japanese test below guards against: 5 characters of オプション are not 5 words
    assert _per_char_dup_frac(JA_MANUAL, 5) > GopherRepetitionSettings().dup_n_grams[5]


@pytest.mark.parametrize(("text", "lang"), [(JA_MANUAL, "ja"), (ZH_MANUAL, "zh")])
def test_ordinary_cjk_prose_with_repeated_words_is_not_flagged(text: str, lang: str) -> None:
    d = doc(text, lang=lang)
    assert GopherRepetitionFilter().filter(d) is True
    sc = d.metadata["scores"]["gopher_repetition"]
    assert sc["dup_n_gram_char_frac"]["5"] < 0.05
    assert GopherQualityFilter().filter(doc(text, lang=lang)) is True
    # untagged (langid off): the script picks the segmenter, the decision is the same
    assert GopherRepetitionFilter().filter(doc(text)) is True


@pytest.mark.parametrize(("text", "lang"), [(JA_SPAM, "ja"), (ZH_SPAM, "zh")])
def test_repetitive_cjk_spam_is_still_flagged(text: str, lang: str) -> None:
    d = doc(text, lang=lang)
    result = GopherRepetitionFilter().filter(d)
    assert result is not True and result[1] in NGRAM_REASONS
    sc = d.metadata["scores"]["gopher_repetition"]
    assert sc["dup_n_gram_char_frac"]["5"] > 0.5
    assert sc["dup_line_frac"] == 0.0  # one line: the n-gram rules, not the line rules, catch it


def test_cjk_runs_are_segmented_into_words() -> None:
    ja = split_words("このオプションを指定すると、ターゲットのファイルが上書きされます。", "ja")
    assert {"オプション", "ターゲット", "ファイル", "上書き"} <= set(ja) and "、" in ja and "。" in ja
    zh = split_words("如果配置文件不存在，命令会使用默认值。", "zh")
    assert {"配置文件", "不", "存在", "命令", "默认值"} <= set(zh)
    mixed = split_words("詳しくは https://example.org/docs を見てください。It's fine.", "ja")
    assert "https://example.org/docs" in mixed and "It" in mixed and "'s" in mixed and "見" in mixed
    # spaced scripts are untouched by the segmenters
    assert split_words("Die Option --force ersetzt Dateien.", "de") == (
        "Die", "Option", "-", "-", "force", "ersetzt", "Dateien", ".")


def test_segmenter_follows_the_language_tag_then_the_script() -> None:
    assert segmenter_lang("東京都", "ja") == "ja" and segmenter_lang("东京", "zh") == "zh"
    assert segmenter_lang("粤语", "yue") == "zh"
    assert segmenter_lang("ファイル", None) == "ja" and segmenter_lang("文件", None) == "zh"
    assert segmenter_lang("A quote: ファイル", "en") == "ja"


def test_long_cjk_run_is_segmented_past_sudachis_input_limit() -> None:
    run = "オプションを指定する" * 3000  # 90,000 UTF-8 bytes: over Sudachi's 49,149-byte limit for one call
    words = segment_cjk(run, "ja")
    assert "".join(words) == run and words.count("オプション") == 3000


def test_c4_counts_cjk_words_not_whitespace_chunks() -> None:
    line = "".join(SAMPLES["zh"] * 2)  # one ordinary line of > 1,000 characters and no space
    assert len(line) > 1000
    d = doc(line, lang="zh")
    assert C4QualityFilter(C4Settings(min_num_sentences=3)).filter(d) is True
    assert d.metadata["scores"]["c4"]["lines_dropped"] == {}
    # a CJK line needs three words, not three characters
    short = doc("谢谢。\n" + line, lang="zh")  # 谢谢 。: two words, three characters
    C4QualityFilter().filter(short)
    assert short.metadata["scores"]["c4"]["lines_dropped"] == {"too_few_words": 1}


def test_gopher_word_count_of_cjk_is_words() -> None:
    text = "".join(SAMPLES["ja"][:4])
    d = doc(text, lang="ja")
    GopherQualityFilter().filter(d)
    n = d.metadata["scores"]["gopher_quality"]["n_words"]
    assert n == sum(1 for w in split_words(text, "ja") if w not in "、。「」") and n < 0.75 * len(text)


def test_a_missing_segmenter_fails_the_build_not_each_document(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmpipe.curation import text
    from llmpipe.curation.config import QualityConfig

    build_quality_filters(QualityConfig())  # installed: builds
    monkeypatch.setitem(text.SEGMENTER_MODULES, "llmpipe_no_such_segmenter", "no-such-segmenter")
    with pytest.raises(RuntimeError, match="no-such-segmenter"):
        build_quality_filters(QualityConfig())
    assert build_quality_filters(QualityConfig(filters=[])) == []


@pytest.mark.parametrize("lang", ["ja", "zh"])
def test_batched_segmentation_equals_run_by_run(lang: str) -> None:
    text = "".join(SAMPLES[lang]) + (JA_MANUAL if lang == "ja" else ZH_MANUAL)
    runs = cjk_runs(text)
    assert len(runs) > 80
    assert segment_runs(runs, lang) == [segment_cjk(r, lang) for r in runs]
