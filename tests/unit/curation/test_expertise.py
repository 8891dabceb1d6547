"""Expertise: a fastText classifier trained in the stage (DCLM-style) separates reference text from
the corpus; its artifact reloads and scores identically; threshold and top-fraction rules; funnel."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from llmpipe.curation import expertise as ex
from llmpipe.curation.dimensions_config import ExpertiseConfig
from llmpipe.document import Document, read_shard, rejected_paths, shard_paths
from tests.fixtures.quality_corpus import boilerplate, documents, run_stage, textbook

EXPERTISE_BIN = "model/expertise.bin"


def _corpus() -> list[Document]:
    """A corpus of everyday text (en, de, zh), some navigation junk and a few textbook documents."""
    import random

    rng = random.Random(0)
    docs = [Document(f"{lang}-{i}", t, "web", {"lang": lang, "kind": "web"})
            for lang in ("en", "de", "zh") for i, t in enumerate(documents(lang, 80, seed=3))]
    docs += [Document(f"nav-{i}", boilerplate(t, rng, "en"), "web", {"lang": "en", "kind": "web"})
             for i, t in enumerate(documents("en", 20, seed=4))]
    docs += [Document(f"edu-{i}", t, "web", {"lang": "en", "kind": "edu"}) for i, t in enumerate(textbook(20, seed=5))]
    return docs


def _reference(tmp: Path) -> str:
    path = tmp / "reference.txt"
    path.write_text("\n".join(textbook(200, seed=1)) + "\n")
    return str(path)


def _all(out: Path) -> list[Document]:
    return [d for p in [*shard_paths(out), *rejected_paths(out)] for d in read_shard(p)]


def test_trained_classifier_separates_reference_from_corpus_and_reloads(tmp_path: Path) -> None:
    cfg = ExpertiseConfig(enabled=True, reference=[_reference(tmp_path)], negatives=200, threshold=0.5)
    stats, out = run_stage("expertise", cfg, _corpus(), tmp_path)
    assert stats["training"]["holdout_auc"] >= 0.9
    # held-out data the stage never saw: fresh textbook documents against fresh corpus text
    model = ex.load_classifier(str(out / EXPERTISE_BIN))
    pos = ex.positive_probability(model, [ex.prepare(t, "en") for t in textbook(50, seed=9)], cfg.label)
    neg = ex.positive_probability(model, [ex.prepare(t, lang) for lang in ("en", "de", "zh")
                                          for t in documents(lang, 30, seed=9)], cfg.label)
    assert ex.auc(pos, neg) >= 0.9
    # the artifact's model, reloaded by either package, gives every document its stored score
    import fasttext_new

    again = fasttext_new.load_model(str(out / EXPERTISE_BIN))
    docs = _all(out)
    for d in docs:
        text = ex.prepare(d.text, d.metadata["lang"])
        stored = d.metadata["scores"]["expertise"]["expertise_score"]
        assert stored == round(ex.positive_probability(model, [text], cfg.label)[0], 6)
        assert abs(stored - ex.positive_probability(again, [text], cfg.label)[0]) < 1e-6
    assert stats["docs_in"] == len(docs) == stats["docs_kept"] + sum(stats["rejected"].values())
    kept = [d for p in shard_paths(out) for d in read_shard(p)]
    # the negatives are a random corpus sample, so a textbook document drawn among them may score low
    assert {d.metadata["kind"] for d in kept} == {"edu"} and len(kept) >= 18
    for p in rejected_paths(out):
        for d in read_shard(p):
            assert d.metadata["reject_reason"] == "low_expertise" and d.metadata["rejected_by"] == "expertise"
            assert d.metadata["scores"]["expertise"]["expertise_score"] < 0.5


def test_same_data_same_model_bytes_and_top_fraction(tmp_path: Path) -> None:
    ref = _reference(tmp_path)
    cfg = ExpertiseConfig(enabled=True, reference=[ref], negatives=200, rule="top_fraction", top_fraction=0.05)
    stats_a, a = run_stage("expertise", cfg, _corpus(), tmp_path / "a")
    _, b = run_stage("expertise", cfg, _corpus(), tmp_path / "b")
    digest = [hashlib.sha256((d / EXPERTISE_BIN).read_bytes()).hexdigest() for d in (a, b)]
    assert digest[0] == digest[1]
    kept = [d for p in shard_paths(a) for d in read_shard(p)]
    assert len(kept) == round(0.05 * stats_a["docs_in"]) and {d.metadata["kind"] for d in kept} == {"edu"}


def test_existing_model_by_path(tmp_path: Path) -> None:
    """A model file named by ``model_path`` scores as the trained one did (same file, same scores)."""
    cfg = ExpertiseConfig(enabled=True, reference=[_reference(tmp_path)], negatives=200)
    stats, out = run_stage("expertise", cfg, _corpus(), tmp_path / "train")
    by_path = ExpertiseConfig(enabled=True, model_path=str(out / EXPERTISE_BIN))
    stats2, _ = run_stage("expertise", by_path, _corpus(), tmp_path / "load")
    assert stats2["rejected"] == stats["rejected"] and stats2["training"] == {}
    with pytest.raises(FileNotFoundError, match="expertise.model_path"):
        run_stage("expertise", ExpertiseConfig(enabled=True, model_path=str(tmp_path / "nope.bin")), _corpus(),
                  tmp_path / "missing")
    with pytest.raises(ValueError, match="exactly one of model_path"):
        ExpertiseConfig(enabled=True)


def test_transformers_classifier_by_path(tmp_path: Path) -> None:
    """A sequence-classification checkpoint (FineWeb-Edu style): its class probability is the score."""
    from tests.fixtures.quality_corpus import train_tiny_classifier

    ckpt = train_tiny_classifier(tmp_path / "clf")
    cfg = ExpertiseConfig(enabled=True, hf_model_path=str(ckpt), hf_label="edu", threshold=0.5)
    stats, out = run_stage("expertise", cfg, _corpus(), tmp_path / "run")
    docs = _all(out)
    pos = [d.metadata["scores"]["expertise"]["expertise_score"] for d in docs if d.metadata["kind"] == "edu"]
    neg = [d.metadata["scores"]["expertise"]["expertise_score"] for d in docs if d.metadata["kind"] == "web"]
    assert ex.auc(pos, neg) >= 0.9
    assert stats["docs_in"] == len(docs) == stats["docs_kept"] + sum(stats["rejected"].values())
    # the stored score is the checkpoint's own softmax for the class, document by document
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tok = AutoModelForSequenceClassification.from_pretrained(ckpt).eval(), AutoTokenizer.from_pretrained(ckpt)
    for d in docs[:5]:
        with torch.no_grad():
            p = torch.softmax(model(**tok(d.text, truncation=True, max_length=256, return_tensors="pt")).logits, -1)
        assert abs(float(p[0, 1]) - d.metadata["scores"]["expertise"]["expertise_score"]) < 1e-5
    with pytest.raises(ValueError, match="'hq' is not a label of the model"):
        run_stage("expertise", ExpertiseConfig(enabled=True, hf_model_path=str(ckpt), hf_label="hq"), _corpus(),
                  tmp_path / "bad")


def test_builtin_reference_set(tmp_path: Path) -> None:
    """``builtin:pydoc`` (Python's reference manual, what configs/tiny.yaml trains on) and a clear error."""
    from llmpipe.curation.scored import reference_texts

    texts = reference_texts(None, "builtin:pydoc", "expertise.reference")  # type: ignore[arg-type]
    assert len(texts) >= 30 and all(len(t.split()) >= 50 for t in texts)
    with pytest.raises(ValueError, match="expertise.reference: unknown built-in reference 'builtin:nope'"):
        reference_texts(None, "builtin:nope", "expertise.reference")  # type: ignore[arg-type]
    cfg = ExpertiseConfig(enabled=True, reference=["builtin:pydoc"], negatives=100, threshold=0.0)
    stats, _ = run_stage("expertise", cfg, _corpus(), tmp_path)
    assert stats["rejected"] == {} and stats["training"]["holdout_auc"] >= 0.9
