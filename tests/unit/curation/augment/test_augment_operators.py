"""The augment operators and the augment stage, with real tiny models on the model-based paths."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmpipe.curation.augment.config import AugmentConfig
from llmpipe.curation.augment.operators import (
    _longest_matches,
    find_entities,
    load_synonym_table,
    split_sentences,
)
from llmpipe.curation.augment.stage import augment_documents, run_augment
from llmpipe.document import Document, read_shard, write_shard
from tests.unit.curation.augment.conftest import EN, ZH


def _docs() -> list[Document]:
    docs = [Document(f"en{i}", t, "web", {"lang": "en"}) for i, t in enumerate(EN)]
    return docs + [Document(f"zh{i}", t, "wiki", {"lang": "zh"}) for i, t in enumerate(ZH)]


def _cfg(*ops: dict, seed: int = 7) -> AugmentConfig:
    return AugmentConfig(enabled=True, seed=seed, operators=list(ops))


def test_synonyms_change_words_from_the_table_and_keep_lineage() -> None:
    out, st = augment_documents(_docs(), _cfg({"type": "synonym", "fraction": 1.0, "probability": 0.5}))
    assert st["synonym"]["selected"] == 6 and st["synonym"]["augmented_docs"] == len(out) == 6
    by_parent = {d.metadata["parent_id"]: d for d in out}
    for parent in _docs():
        child = by_parent[parent.id]
        assert child.text != parent.text and child.id != parent.id
        assert child.metadata["lang"] == parent.metadata["lang"] and child.source == parent.source
        assert child.metadata["augment_op"] == "synonym" and child.metadata["augment_seed"] == 7


def test_zh_longest_match_prefers_the_longest_entry() -> None:
    table = {"高兴": ["开心"], "高": ["矮"], "城市": ["都市"]}
    assert _longest_matches("我很高兴住在城市", table, 2) == [(2, 4, "高兴"), (6, 8, "城市")]


def test_same_seed_same_output_other_seed_differs() -> None:
    ops = ({"type": "synonym", "fraction": 1.0, "probability": 0.5},
           {"type": "restructure", "fraction": 1.0, "probability": 1.0},
           {"type": "template", "fraction": 1.0})
    a, sa = augment_documents(_docs(), _cfg(*ops, seed=1))
    b, sb = augment_documents(_docs(), _cfg(*ops, seed=1))
    c, _ = augment_documents(_docs(), _cfg(*ops, seed=2))
    assert [(d.id, d.text) for d in a] == [(d.id, d.text) for d in b] and sa == sb
    assert [d.text for d in a] != [d.text for d in c]
    # a document's augmentation does not depend on its neighbours in the shard
    alone, _ = augment_documents(_docs()[1:2], _cfg(ops[0], seed=1))
    assert alone[0].text == next(d.text for d in a if d.metadata["parent_id"] == "en1"
                                 and d.metadata["augment_op"] == "synonym")


def test_fraction_selects_about_that_share() -> None:
    docs = [Document(f"d{i}", "The big house is near the old city.", "s", {"lang": "en"}) for i in range(2000)]
    _, st = augment_documents(docs, _cfg({"type": "synonym", "fraction": 0.25, "probability": 0.2}))
    assert 0.22 < st["synonym"]["selected"] / 2000 < 0.28


def test_restructure_permutes_sentences_and_keeps_them() -> None:
    out, _ = augment_documents(_docs(), _cfg({"type": "restructure", "fraction": 1.0, "probability": 1.0}))
    for d in out:
        parent = next(p for p in _docs() if p.id == d.metadata["parent_id"])
        assert d.text != parent.text
        assert sorted(split_sentences(d.text)) == sorted(split_sentences(parent.text))


def test_templates_fill_slots_from_document_entities() -> None:
    docs = [Document("a", "Yesterday Maria Lopez counted 42 boats near Lisbon.", "s", {"lang": "en"})]
    ents = find_entities(docs[0].text)
    assert "Maria Lopez" in ents["capitalized"] and "Lisbon" in ents["capitalized"] and ents["number"] == ["42"]
    assert "Yesterday" not in ents["capitalized"]
    out, _ = augment_documents(docs, _cfg({"type": "template", "fraction": 1.0, "per_document": 3,
                                           "templates": ["{ENTITY} has {NUMBER} {THING}."],
                                           "templates_file": None, "values": {"THING": ["ships"]}}))
    texts = [d.text for d in out]
    assert len(texts) == 3 and len({d.id for d in out}) == 3
    assert all(t.endswith(" 42 ships.") and t.split(" has ")[0] in ents["capitalized"] for t in texts)


def test_bad_synonym_table_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "syn.tsv"
    p.write_text("# ok\nbig\tlarge\nbroken line without tab\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"syn\.tsv:3: expected"):
        load_synonym_table(p)


def test_config_errors_are_clear() -> None:
    with pytest.raises(ValidationError, match=r"must be in \[0, 1\], got 1.5"):
        AugmentConfig(operators=[{"type": "synonym", "fraction": 1.5}])
    with pytest.raises(ValidationError, match="used twice"):
        AugmentConfig(operators=[{"type": "synonym"}, {"type": "synonym"}])
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        AugmentConfig(operators=[{"type": "paraphrase"}])


def test_contextual_replacement_runs_a_real_masked_lm(tiny_mlm_dir: Path) -> None:
    op = {"type": "contextual", "fraction": 1.0, "probability": 0.3, "model": str(tiny_mlm_dir), "top_k": 50}
    a, st = augment_documents(_docs(), _cfg(op))
    b, _ = augment_documents(_docs(), _cfg(op))
    assert st["contextual"]["selected"] == 6
    assert st["contextual"]["augmented_docs"] >= 1  # a random tiny model still predicts some letters
    assert [d.text for d in a] == [d.text for d in b]
    for d in a:
        assert d.text != next(p.text for p in _docs() if p.id == d.metadata["parent_id"])


def test_back_translation_runs_a_real_marian_chain(tiny_marian_chain: list[Path]) -> None:
    op = {"type": "back_translation", "fraction": 1.0, "chain": [str(p) for p in tiny_marian_chain],
          "max_new_tokens": 8}
    a, st = augment_documents(_docs(), _cfg(op))
    b, _ = augment_documents(_docs(), _cfg(op))
    s = st["back_translation"]
    assert s["selected"] == 6 and s["augmented_docs"] + sum(s["skipped"].values()) == 6
    assert s["augmented_docs"] >= 1 and all(d.metadata["augment_type"] == "back_translation" for d in a)
    assert [d.text for d in a] == [d.text for d in b]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_stage_off_passes_shards_through(tmp_path: Path, make_ctx) -> None:
    src = tmp_path / "timeliness"
    write_shard(src / "shards" / "part-0.parquet", _docs())
    ctx = make_ctx("augment", AugmentConfig(), {"timeliness": src}, tmp_path / "out")
    stats = run_augment(ctx)
    assert stats["enabled"] is False and stats["docs_out"] == 6
    assert _sha(ctx.out / "shards" / "part-0.parquet") == _sha(src / "shards" / "part-0.parquet")
    funnel = json.loads((ctx.out / "funnel.json").read_text())  # the shared funnel, off or on
    assert funnel == {"in": 6, "kept": 6, "rejected": {}, "filters": {}, "added": {}, "out": 6}
    assert (ctx.out / "funnel.png").is_file()


def test_stage_on_writes_originals_and_children_and_caches_shards(tmp_path: Path, make_ctx) -> None:
    src = tmp_path / "timeliness"
    write_shard(src / "shards" / "part-0.parquet", _docs()[:3])
    write_shard(src / "shards" / "part-1.parquet", _docs()[3:])
    cfg = _cfg({"type": "synonym", "fraction": 1.0}, {"type": "restructure", "fraction": 0.5})
    ctx = make_ctx("augment", cfg, {"timeliness": src}, tmp_path / "out1", workers=2)
    stats = run_augment(ctx)
    docs = read_shard(ctx.out / "shards" / "part-0.parquet") + read_shard(ctx.out / "shards" / "part-1.parquet")
    children = [d for d in docs if "parent_id" in d.metadata]
    assert stats["docs_in"] == 6 and stats["docs_out"] == len(docs) == 6 + len(children)
    assert stats["augmented_docs"] == len(children) == sum(v["augmented_docs"] for v in stats["operators"].values())
    assert len({d.id for d in docs}) == len(docs)
    assert ctx.reports and ctx.reports[0].key == "augment-operators"
    # second run: every shard from the cache, identical bytes
    ctx2 = make_ctx("augment", cfg, {"timeliness": src}, tmp_path / "out2")
    run_augment(ctx2)
    for name in ("part-0.parquet", "part-1.parquet"):
        assert _sha(ctx2.out / "shards" / name) == _sha(ctx.out / "shards" / name)


def test_stage_missing_model_names_the_config_key(tmp_path: Path, make_ctx) -> None:
    src = tmp_path / "timeliness"
    write_shard(src / "shards" / "part-0.parquet", _docs())
    cfg = _cfg({"type": "contextual", "model": str(tmp_path / "nope")})
    with pytest.raises(FileNotFoundError, match=r"augment\.operators\[0\]\.model"):
        run_augment(make_ctx("augment", cfg, {"timeliness": src}, tmp_path / "out"))
