"""Recency weights in the tokenize mix: the timeliness stage's ``recency_weight`` scales a document's share
of the packed train tokens; absent means 1; the same config gives the same bytes; validation is not mixed."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmpipe.curation.dimensions_config import TimelinessConfig
from llmpipe.curation.timeliness import decide
from llmpipe.document import Document
from llmpipe.tokenization.config import TokenizeConfig
from llmpipe.tokenization.stage import copies_by_error_diffusion, run_tokenize
from llmpipe.tokenization.tokenizer import load_for_encoding
from tests.unit.tokenization.test_tokenization_stage import _docs_of

HALF_LIFE = TimelinessConfig(enabled=True, reference_date=dt.date(2026, 1, 1), half_life_days=365)


def _weight(age_days: int) -> float:
    """The weight the timeliness stage writes for a document of that age (two half-lives: 0.25)."""
    return decide({"date": "2024-01-01", "age_days": age_days}, HALF_LIFE).meta["recency_weight"]


def _corpus(synth, weight_of_old: float | None, weight_of_new: float | None = None, zh_weight: float | None = None
            ) -> list[Document]:
    """en documents, every other one old; zh documents optionally weighted too."""
    docs = []
    for i, d in enumerate(synth(240, 80, seed=11)):
        meta = dict(d.metadata)
        w = zh_weight if meta["lang"] == "zh" else (weight_of_old if i % 2 else weight_of_new)
        if w is not None:
            meta["recency_weight"] = w
        docs.append(Document(d.id, f"{d.id}: {d.text}", d.source, meta))  # the id makes every text unique
    return docs


def _run(make_ctx, dirs: dict[str, Path], out: Path, store: Path | None = None, **cfg: Any) -> dict[str, Any]:
    ctx = make_ctx("tokenize", TokenizeConfig(seq_len=64, **cfg), dirs, out, store_dir=store)
    return run_tokenize(ctx)


def _train_tokens_by_weight(out: Path, tok_dir: Path, docs: list[Document]) -> dict[float, int]:
    """Packed train tokens (EOS included) per recency weight, measured by decoding the packed data."""
    bare, _ = load_for_encoding(tok_dir)
    weight = {d.text: d.metadata.get("recency_weight", 1.0) for d in docs}
    counts: dict[float, int] = {}
    for text in _docs_of(out, tok_dir, "train"):
        w = weight[text]
        counts[w] = counts.get(w, 0) + len(bare.encode(text, add_special_tokens=False).ids) + 1
    return counts


def _hashes(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir()) if p.suffix == ".bin"}


def test_old_documents_are_sampled_at_their_recency_weight(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    old = _weight(730)
    assert old == 0.25
    docs = _corpus(synth, old)
    dirs = pipeline_dirs([docs[:160], docs[160:]])
    _run(make_ctx, dirs, tmp_path / "off", val_fraction=0.0, recency_weighting=False)
    natural = _train_tokens_by_weight(tmp_path / "off", dirs["tokenizer"], docs)
    stats = _run(make_ctx, dirs, tmp_path / "on", val_fraction=0.0)
    weighted = _train_tokens_by_weight(tmp_path / "on", dirs["tokenizer"], docs)
    assert weighted[1.0] == natural[1.0]  # weight-1 documents: exactly once, as without weighting
    ratio = weighted[old] / natural[old]
    assert abs(ratio - old) < 0.02, (ratio, weighted, natural)
    rec = stats["recency"]
    assert rec["enabled"] and rec["weighted_docs"] == sum(1 for d in docs if "recency_weight" in d.metadata)
    assert rec["weighted_docs_tokens_before"] == natural[old] and rec["weighted_docs_tokens_after"] == weighted[old]
    assert rec["train_tokens_before"] == natural[1.0] + natural[old]
    assert abs(rec["train_tokens_weighted"] - (natural[1.0] + old * natural[old])) <= 1
    assert stats["train_tokens"] < rec["train_tokens_before"]
    row = {r["lang"]: r for r in stats["languages"]}
    assert row["en"]["train_tokens_recency"] < row["en"]["train_tokens_before"]
    assert row["zh"]["train_tokens_recency"] == row["zh"]["train_tokens_before"]


def test_missing_weight_is_one_and_reruns_give_the_same_bytes(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    absent = pipeline_dirs([_corpus(synth, 0.25)], name="absent")
    explicit = pipeline_dirs([_corpus(synth, 0.25, weight_of_new=1.0)], name="explicit")
    _run(make_ctx, absent, tmp_path / "a1", store=tmp_path / "s1", val_fraction=0.1)
    _run(make_ctx, absent, tmp_path / "a2", store=tmp_path / "s2", val_fraction=0.1)
    _run(make_ctx, explicit, tmp_path / "e", store=tmp_path / "s3", val_fraction=0.1)
    a1 = _hashes(tmp_path / "a1")
    assert a1 and a1 == _hashes(tmp_path / "a2") == _hashes(tmp_path / "e")
    # validation keeps the natural distribution: the same val bytes with the weights ignored
    _run(make_ctx, absent, tmp_path / "off", store=tmp_path / "s4", val_fraction=0.1, recency_weighting=False)
    off = _hashes(tmp_path / "off")
    assert {k: v for k, v in off.items() if k.startswith("val")} == {k: v for k, v in a1.items() if k.startswith("val")}
    assert {k: v for k, v in off.items() if k.startswith("train")} != {k: v for k, v in a1.items()
                                                                        if k.startswith("train")}


def test_language_shares_hold_after_recency_weights(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    docs = _corpus(synth, 0.25, zh_weight=0.5)
    dirs = pipeline_dirs([docs])
    stats = _run(make_ctx, dirs, tmp_path / "tok", val_fraction=0.0, language_shares={"en": 0.5, "zh": 0.5})
    index = json.loads((tmp_path / "tok" / "index.json").read_text())
    assert index["splits"]["train"]["tokens"] == stats["train_tokens"]
    after = {r["lang"]: r["train_tokens_after"] for r in stats["languages"]}
    assert abs(after["zh"] / sum(after.values()) - 0.5) < 0.02, after


def test_copies_are_floor_or_ceil_of_the_factor_and_track_the_target() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=2000)
    factor = rng.choice([0.0, 0.25, 1.0, 2.6], size=lengths.size)
    k = copies_by_error_diffusion(lengths, factor)
    assert ((k == np.floor(factor)) | (k == np.ceil(factor))).all()
    assert (k[factor == 0.0] == 0).all() and (k[factor == 1.0] == 1).all()
    assert abs(int((k * lengths).sum()) - float((factor * lengths).sum())) <= lengths.max() / 2
    assert (copies_by_error_diffusion(lengths, 1.0) == 1).all()
    with pytest.raises(ValueError, match="negative"):
        copies_by_error_diffusion(lengths[:2], np.array([1.0, -0.5]))


@pytest.mark.parametrize("bad", ["0.5", -1.0, True])
def test_a_bad_recency_weight_is_an_error_naming_the_document(pipeline_dirs, make_ctx, tmp_path, bad) -> None:
    docs = [Document("ok", "the old market by the river", "s", {"lang": "en", "recency_weight": 0.5}),
            Document("bad", "the new market by the river", "s", {"lang": "en", "recency_weight": bad})]
    dirs = pipeline_dirs([docs])
    with pytest.raises(ValueError, match=r"'bad'.*metadata\.recency_weight"):
        _run(make_ctx, dirs, tmp_path / "tok", val_fraction=0.0)


def test_a_share_for_a_language_weighted_to_zero_is_a_clear_error(pipeline_dirs, synth, make_ctx, tmp_path) -> None:
    dirs = pipeline_dirs([_corpus(synth, 0.5, zh_weight=0.0)])
    with pytest.raises(ValueError, match=r"languages \['zh'\] have a share but no train tokens \(recency-weighted"):
        _run(make_ctx, dirs, tmp_path / "tok", val_fraction=0.0, language_shares={"en": 0.5, "zh": 0.5})
    stats = _run(make_ctx, dirs, tmp_path / "off", val_fraction=0.0, language_shares={"en": 0.5, "zh": 0.5},
                 recency_weighting=False)
    assert {r["lang"]: r["train_tokens_after"] > 0 for r in stats["languages"]} == {"en": True, "zh": True}
