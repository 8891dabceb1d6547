"""The NER path: a real ``from_pretrained`` token-classification checkpoint, trained for a few steps on a
tiny labelled set, finds the planted names in sentences it never saw, with exact spans, also in
documents longer than one window; and the recognizer batches across documents."""

from __future__ import annotations

from pathlib import Path

from llmpipe.curation.entities.config import EntitiesConfig, NerSettings
from llmpipe.curation.entities.ner import TokenClassifier, split_label
from llmpipe.curation.entities.spans import check_spans
from llmpipe.curation.entities.stage import EntityTagger
from tests.fixtures.curation_docs import doc
from tests.fixtures.threads import one_thread

UNSEEN = [  # new sentences: the names are planted, the templates are not the training ones
    ("after lunch Greta Novak visited the museum with Jonas .", ["Greta Novak", "Jonas"]),
    ("many people came to see Hiroshi Tanaka and Ingrid at the market .", ["Hiroshi Tanaka", "Ingrid"]),
    ("nothing here at all , just words .", []),
    ("it rained all day , so Elena Moreau stayed home .", ["Elena Moreau"]),
]


def test_ner_finds_planted_names_with_exact_spans(tiny_ner_dir: Path) -> None:
    tc = TokenClassifier(NerSettings(), str(tiny_ner_dir))
    results = tc.recognize([t for t, _ in UNSEEN])
    for (text, names), spans in zip(UNSEEN, results, strict=True):
        check_spans(text, spans, "ner")
        assert [s["text"] for s in spans] == names, text
        assert all(s["label"] == "PER" and 0.5 <= s["score"] <= 1.0 for s in spans)


def test_ner_reads_long_documents_in_windows(tiny_ner_dir: Path) -> None:
    tc = TokenClassifier(NerSettings(max_length=32, stride=8, batch_size=4), str(tiny_ner_dir))
    filler = "the river was quiet and the park was empty . " * 12
    text = "Bruno Okafor said the plan was good . " + filler + "we called Chen Schulz about the new budget . " + filler
    with one_thread():
        spans = tc.recognize([text])[0]
        batched = tc.recognize([text, UNSEEN[0][0]])[0]
    check_spans(text, spans, "windows")
    # both planted names, one in the first window and one many windows later (a 30-step tiny model may
    # also tag a filler word on some machines: precision is the unseen-sentences test's business)
    planted = [s for s in spans if s["text"] in ("Bruno Okafor", "Chen Schulz")]
    assert [s["text"] for s in planted] == ["Bruno Okafor", "Chen Schulz"], spans
    # the same planted spans when the document shares its batch: batching changes nothing
    def where(found: list[dict]) -> list[tuple]:
        return [(s["start"], s["end"], s["label"]) for s in found if s["text"] in ("Bruno Okafor", "Chen Schulz")]

    assert where(batched) == where(planted)


def test_tagger_merges_rules_and_ner_per_language(tiny_ner_dir: Path) -> None:
    cfg = EntitiesConfig(enabled=True, recognizers={"en": ["ner", "rules"], "*": ["rules"]},
                         ner={"model": str(tiny_ner_dir)})
    tagger = EntityTagger(cfg)
    en = doc("yesterday Alice Martin met the mayor in the city hall on 2024-03-05 .", lang="en")
    de = doc("Alice Martin kam am 5. März 2024 nach Hause.", lang="de")  # rules only: no PER
    assert tagger.filter_batch([en, de]) == [True, True]
    assert [(s["label"], s["text"]) for s in en.metadata["entities"]] == [("PER", "Alice Martin"), ("DATE", "2024-03-05")]
    assert [(s["label"], s["text"]) for s in de.metadata["entities"]] == [("DATE", "5. März 2024")]
    assert dict(tagger.stats) == {"PER": 1, "DATE": 2}


def test_bio_labels() -> None:
    assert split_label("B-PER") == ("B", "PER") and split_label("I-ORG") == ("I", "ORG")
    assert split_label("O") == ("O", None) and split_label("LOC") == ("I", "LOC")
