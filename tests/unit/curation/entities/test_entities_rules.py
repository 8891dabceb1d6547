"""The rule recognizer: exact spans on English, German, Chinese and Japanese texts (dates, money, URLs,
gazetteer names), NFKC-normalized matching that never shifts offsets, gazetteer errors naming the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpipe.curation.entities.config import RuleSettings
from llmpipe.curation.entities.rules import RuleRecognizer
from llmpipe.curation.entities.spans import check_spans, protect, restore, shift

GAZETTEER = "Angela Merkel\tPER\nBerlin\tLOC\n李明\tPER\n北京大学\tORG\n東京タワー\tLOC\n田中太郎\tPER\nAnna\tPER\n"


@pytest.fixture
def rec(tmp_path: Path) -> RuleRecognizer:
    (tmp_path / "g.tsv").write_text("# names\n" + GAZETTEER, encoding="utf-8")
    return RuleRecognizer(RuleSettings(gazetteers=[str(tmp_path / "g.tsv")]))


def _found(rec: RuleRecognizer, text: str) -> list[tuple[str, str]]:
    spans = rec.recognize([text])[0]
    check_spans(text, spans, "test")  # text == doc.text[start:end], sorted, no overlap
    return [(s["label"], s["text"]) for s in spans]


CASES = {
    "en": ("On March 5, 2024 at 2:30 pm Angela Merkel paid $5 million (12%) for 3.5 km of road in Berlin; "
           "see https://example.com/a?b=1. Mail jane.roe@example.org.",
           [("DATE", "March 5, 2024"), ("TIME", "2:30 pm"), ("PER", "Angela Merkel"), ("MONEY", "$5 million"),
            ("PERCENT", "12%"), ("QUANTITY", "3.5 km"), ("LOC", "Berlin"), ("URL", "https://example.com/a?b=1"),
            ("EMAIL", "jane.roe@example.org")]),
    "de": ("Am 5. März 2024 um 14:30 Uhr kostete das Ticket in Berlin 12,50 € und 30 Prozent mehr; "
           "Termin 7.4.2024, Strecke 20 km, Infos unter www.example.de.",
           [("DATE", "5. März 2024"), ("TIME", "14:30 Uhr"), ("LOC", "Berlin"), ("MONEY", "12,50 €"),
            ("PERCENT", "30 Prozent"), ("DATE", "7.4.2024"), ("QUANTITY", "20 km"), ("URL", "www.example.de")]),
    "zh": ("2024年3月5日下午3点，李明在北京大学花了500万元购买了20公里道路，增长了15%。访问https://example.cn了解详情。",
           [("DATE", "2024年3月5日"), ("TIME", "下午3点"), ("PER", "李明"), ("ORG", "北京大学"), ("MONEY", "500万元"),
            ("QUANTITY", "20公里"), ("PERCENT", "15%"), ("URL", "https://example.cn")]),
    "ja": ("2024年3月5日午後3時、田中太郎は東京タワーで1000円を払い、5キロ歩いた。詳細はhttps://example.jpへ。",
           [("DATE", "2024年3月5日"), ("TIME", "午後3時"), ("PER", "田中太郎"), ("LOC", "東京タワー"), ("MONEY", "1000円"),
            ("QUANTITY", "5キロ"), ("URL", "https://example.jp")]),
}


@pytest.mark.parametrize("lang", sorted(CASES))
def test_spans_are_exact_in_four_languages(rec: RuleRecognizer, lang: str) -> None:
    text, expected = CASES[lang]
    assert _found(rec, text) == expected


def test_nfkc_forms_match_without_shifting_offsets(rec: RuleRecognizer) -> None:
    # full-width digits, a ligature and a full-width currency sign before and inside the entities
    text = "ﬁnal ﬁgures: ２０２４年３月５日、李明は＄３０と１５％を払った。Ｂｅｒｌｉｎ ﬁne"
    spans = rec.recognize([text])[0]
    check_spans(text, spans, "nfkc")
    assert [(s["label"], s["text"]) for s in spans] == [
        ("DATE", "２０２４年３月５日"), ("PER", "李明"), ("MONEY", "＄３０"), ("PERCENT", "１５％"), ("LOC", "Ｂｅｒｌｉｎ")]


def test_gazetteer_word_boundaries_and_longest_form(rec: RuleRecognizer) -> None:
    assert _found(rec, "Annabelle met Anna in Berliner Strasse.") == [("PER", "Anna")]
    assert _found(rec, "我在北京大学见到李明们") == [("ORG", "北京大学"), ("PER", "李明")]  # CJK: characters


def test_gazetteer_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("Berlin\tLOC\nParis LOC\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.tsv:2: expected"):
        RuleRecognizer(RuleSettings(gazetteers=[str(bad)]))
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        RuleRecognizer(RuleSettings(gazetteers=[str(tmp_path / "missing.tsv")]))


def test_protect_restore_and_shift_keep_spans_exact(rec: RuleRecognizer) -> None:
    text = CASES["en"][0]
    spans = rec.recognize([text])[0]
    guarded = protect(text, spans)
    assert "March" not in guarded and "Berlin" not in guarded
    moved = guarded.replace("Mail", "Write to")
    restored = restore(moved, spans)
    assert restored is not None
    new_text, new_spans = restored
    check_spans(new_text, new_spans, "restored")
    assert [s["text"] for s in new_spans] == [s["text"] for s in spans]
    assert restore(guarded[:5], spans) is None  # an operator lost spans: no child
    assert restore(guarded + guarded[3], spans) is None  # or duplicated one
    edited = shift(spans, [(0, 2, "Upon")])
    assert all(e["start"] == s["start"] + 2 for s, e in zip(spans, edited, strict=True))


def test_redaction_replaces_labelled_spans_and_shifts_the_rest(rec: RuleRecognizer) -> None:
    from llmpipe.curation.safety import EntityRedactor, redact_spans
    from tests.fixtures.curation_docs import doc

    text = "Angela Merkel met Anna in Berlin on 2024-03-05; Anna paid $30."
    spans = rec.recognize([text])[0]
    new, kept, counts = redact_spans(text, spans, {"PER"})
    assert new == "<PER> met <PER> in Berlin on 2024-03-05; <PER> paid $30." and counts == {"PER": 3}
    check_spans(new, kept, "redacted")
    assert [s["text"] for s in kept] == ["Berlin", "2024-03-05", "$30"]
    d = doc(text, entities=spans, pii={"email": 1})
    red = EntityRedactor(["PER", "LOC"])
    assert red.filter(d) is True
    assert d.text.startswith("<PER> met <PER> in <LOC> on") and d.metadata["pii"] == {"email": 1, "PER": 3, "LOC": 1}
    assert dict(red.stats) == {"PER": 3, "LOC": 1}
    assert redact_spans(text, spans, set()) == (text, spans, {})
