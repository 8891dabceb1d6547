"""Augmentation keeps entity spans: over 1,000 augmented documents no child alters a span (synonyms and
the masked LM skip entity words, restructuring moves whole spans), children carry their spans shifted,
template children hold the parent's entities, and documents without spans augment as before."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from llmpipe.curation.augment.config import AugmentConfig
from llmpipe.curation.augment.stage import augment_documents
from llmpipe.curation.entities.config import RuleSettings
from llmpipe.curation.entities.rules import RuleRecognizer
from llmpipe.curation.entities.spans import check_spans
from llmpipe.document import Document

# entities full of what the operators act on: synonym-table words ("Big", "Happy"), sentence ends
# ("U.S. Steel", "Dr. Lee") and clause commas ("March 5, 2024", "Paris, Texas")
GAZETTEER = ("Big Happy Foods\tORG\nU.S. Steel\tORG\nDr. Lee\tPER\nParis, Texas\tLOC\nGood Start Inc.\tORG\n"
             "快乐城\tLOC\n美丽花园\tORG\n")
EN = ["Big Happy Foods said the quick plan was good, and the small team was happy.",
      "On March 5, 2024, U.S. Steel bought a big plant in Paris, Texas for $5 million.",
      "Dr. Lee was happy. The fast car was small, but the big house was good.",
      "Good Start Inc. made a great show. People said it was important, easy and fast.",
      "The sad story ended on 2024-06-01 at 14:30, when prices rose 12% overnight."]
ZH = ["快乐城的美丽花园很漂亮。孩子们很高兴，老人们也很快乐。", "2024年3月5日，美丽花园花了500万元。大家都很高兴。"]


def _corpus(tmp_path: Path, n: int) -> list[Document]:
    (tmp_path / "g.tsv").write_text(GAZETTEER, encoding="utf-8")
    rec = RuleRecognizer(RuleSettings(gazetteers=[str(tmp_path / "g.tsv")]))
    rng = random.Random(7)
    docs = []
    for i in range(n):
        zh = i % 5 == 0
        pool = ZH if zh else EN
        text = "\n\n".join(" ".join(rng.sample(pool, k=min(len(pool), 2 + i % 2))) for _ in range(1 + i % 3))
        if zh:
            text = text.replace(" ", "")
        docs.append(Document(f"d{i:05d}", text, "t", {"lang": "zh" if zh else "en",
                                                        "entities": rec.recognize([text])[0]}))
    return docs


def _pairs(spans: list[dict]) -> Counter:
    return Counter((s["label"], s["text"]) for s in spans)


def _config(**extra: object) -> AugmentConfig:
    return AugmentConfig(enabled=True, seed=3, operators=[
        {"type": "synonym", "fraction": 1.0, "probability": 0.5},
        {"type": "restructure", "name": "sentences", "fraction": 1.0, "probability": 1.0},
        {"type": "restructure", "name": "clauses", "unit": "clause", "fraction": 1.0, "probability": 1.0},
        {"type": "template", "fraction": 1.0, "per_document": 2,
         "templates": ["{ORG} was founded on {DATE}.", "{ENTITY} reported {NUMBER} in sales."],
         "entity_slots": {"ORG": "ORG", "DATE": "DATE", "ENTITY": "capitalized", "NUMBER": "number"}},
        *extra.get("operators", [])])


def test_no_child_alters_a_span_over_1000_documents(tmp_path: Path) -> None:
    docs = _corpus(tmp_path, 300)
    parents = {d.id: d for d in docs}
    children, stats = augment_documents(docs, _config())
    assert len(children) >= 1000, stats
    by_op: Counter[str] = Counter()
    for c in children:
        spans = c.metadata["entities"]
        check_spans(c.text, spans, c.id)  # text == child.text[start:end], in order, no overlap
        parent = parents[c.metadata["parent_id"]]
        op = c.metadata["augment_op"]
        by_op[op] += 1
        if op == "template":  # holds the parent's entities only, at their new places
            assert not _pairs(spans) - _pairs(parent.metadata["entities"])
            assert spans, c.text  # every template here has an entity slot
        else:  # every span of the parent, whole and unchanged
            assert _pairs(spans) == _pairs(parent.metadata["entities"]), (op, parent.text, c.text)
            assert c.text != parent.text
    assert set(by_op) == {"synonym", "sentences", "clauses", "template"}
    assert sum(st["skipped"].get("entity_lost", 0) for st in stats.values()) == 0


def test_without_protection_the_same_operators_break_spans(tmp_path: Path) -> None:
    """The control: the spans above are ones the operators really would break when left unguarded."""
    docs = _corpus(tmp_path, 60)
    for d in docs:
        d.metadata["spans_for_check"] = d.metadata.pop("entities")
    children, _ = augment_documents(docs, _config())
    parents = {d.id: d for d in docs}
    broken = 0
    for c in children:
        if c.metadata["augment_op"] == "template":
            continue
        want = Counter(s["text"] for s in parents[c.metadata["parent_id"]].metadata["spans_for_check"])
        broken += any(c.text.count(t) < n for t, n in want.items())
    assert broken > 20


def test_contextual_replacement_skips_entity_words(tmp_path: Path, tiny_mlm_dir: Path) -> None:
    docs = [d for d in _corpus(tmp_path, 40) if d.metadata["lang"] == "en"]
    cfg = AugmentConfig(enabled=True, seed=1, operators=[
        {"type": "contextual", "fraction": 1.0, "probability": 0.6, "model": str(tiny_mlm_dir)}])
    children, stats = augment_documents(docs, cfg)
    assert children, stats
    parents = {d.id: d for d in docs}
    for c in children:
        check_spans(c.text, c.metadata["entities"], c.id)
        assert _pairs(c.metadata["entities"]) == _pairs(parents[c.metadata["parent_id"]].metadata["entities"])


@pytest.mark.parametrize("with_key", [False, True])
def test_documents_without_spans_augment_as_before(tmp_path: Path, with_key: bool) -> None:
    docs = _corpus(tmp_path, 30)
    plain = [Document(d.id, d.text, d.source, {"lang": d.metadata["lang"]}) for d in docs]
    if with_key:
        for d in plain:
            d.metadata["entities"] = []
    a, _ = augment_documents(plain, _config())
    for d in plain:
        d.metadata.pop("entities", None)
    b, _ = augment_documents(plain, _config())
    assert [c.text for c in a] == [c.text for c in b]  # same texts, spans or no spans key
    assert all(("entities" in c.metadata) == with_key for c in a)


def test_back_translation_keeps_sentences_with_entities(tmp_path: Path, tiny_marian_chain: list[Path]) -> None:
    docs = _corpus(tmp_path, 30)
    for d in docs[:10]:  # sentences without any span: these are translated
        d.text += "\n\nthe river was quiet and the park was empty."
    cfg = AugmentConfig(enabled=True, seed=1, operators=[
        {"type": "back_translation", "fraction": 1.0, "chain": [str(p) for p in tiny_marian_chain],
         "max_new_tokens": 8}])
    children, stats = augment_documents(docs, cfg)
    assert children, stats
    parents = {d.id: d for d in docs}
    for c in children:
        parent = parents[c.metadata["parent_id"]]
        check_spans(c.text, c.metadata["entities"], c.id)
        assert _pairs(c.metadata["entities"]) == _pairs(parent.metadata["entities"])
        assert "the river was quiet and the park was empty." not in c.text  # that sentence was translated
