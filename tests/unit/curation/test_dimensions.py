"""The four quality-dimension stages in the DAG: their place, the one funnel each writes (in = kept +
sum(rejected), counted from the files), scores kept on every document, and pass-through when off."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest

from llmpipe.config import load_config
from llmpipe.curation.funnel import KEYS, check_funnel
from llmpipe.dag import run_pipeline
from llmpipe.document import input_shards, read_shard, rejected_paths, shard_paths
from llmpipe.pipeline import load_stages
from tests.fixtures.quality_corpus import documents, labelled_corpus, textbook, write_reference

DIMENSIONS = ("coherence", "expertise", "diversity", "timeliness")
UPSTREAM = {"coherence": "quality", "expertise": "coherence", "safety": "expertise", "diversity": "dedup",
            "timeliness": "diversity", "augment": "timeliness"}


def test_the_dag_places_the_five_dimensions() -> None:
    order = list(load_stages())
    seq = ["ingest", "langid", "quality", "coherence", "expertise", "safety", "dedup", "diversity", "timeliness",
           "augment", "tokenizer"]
    assert [order.index(n) for n in seq] == sorted(order.index(n) for n in seq)
    specs = load_stages()
    assert {name: specs[name].inputs[0] for name in UPSTREAM} == UPSTREAM


def _source(tmp: Path) -> Path:
    rows = [{"text": d.text, "date": f"20{10 + i % 16:02d}-01-01"} for i, d in
            enumerate(d for lang in ("en", "de", "zh") for d in labelled_corpus(lang, 24, 4))]
    rows += [{"text": t} for t in textbook(12, seed=3)]
    rng = random.Random(0)
    for t in documents("en", 8, seed=2):  # the first natural en documents, sentences reordered: MinHash misses
        sents = re.split(r"(?<=\.) ", t)
        rng.shuffle(sents)
        rows.append({"text": " ".join(sents), "date": "2025-01-01"})
    src = tmp / "src" / "a.jsonl"
    src.parent.mkdir(parents=True)
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return src.parent


def _config(tmp: Path, enabled: bool) -> object:
    refs = {lang: [str(write_reference(tmp / "ref" / f"{lang}.txt", lang))] for lang in ("en", "de", "zh")}
    edu = tmp / "ref" / "edu.txt"
    edu.write_text("\n".join(textbook(100, seed=1) + documents("en", 20, seed=8)) + "\n")
    return load_config(data={
        "name": "dims", "store": str(tmp / "store"), "state_dir": str(tmp / "state"),
        "sources": [{"name": "web", "path": str(_source(tmp)), "format": "jsonl"}],
        "executor": {"kind": "local", "workers": 2},
        "langid": {"languages": ["en", "de", "zh"], "default_threshold": 0.3},
        "quality": {"filters": []},
        "coherence": {"enabled": enabled, "reference": refs},
        "expertise": {"enabled": enabled, "reference": [str(edu)], "negatives": 60, "rule": "top_fraction",
                      "top_fraction": 0.8},
        "diversity": {"enabled": enabled, "clusters": 4, "max_cluster_share": 0.6},
        "timeliness": {"enabled": enabled, "reference_date": "2026-01-01", "max_age_days": 3650},
    })


def _rows(paths: list[Path]) -> int:
    return sum(len(read_shard(p)) for p in paths)


def test_every_dimension_stage_writes_the_funnel_and_keeps_scores(tmp_path: Path) -> None:
    pytest.importorskip("kenlm", reason="kenlm is not installed (pip install 'llmpipe[coherence]')")
    runs = {r.stage: r for r in run_pipeline(_config(tmp_path, True), until="augment")}
    for name in DIMENSIONS:
        out = Path(runs[name].path)
        funnel = json.loads((out / "funnel.json").read_text())
        assert set(KEYS) <= set(funnel), name
        check_funnel(funnel, where=name)
        assert funnel["in"] == _rows([s.path for s in input_shards(runs[UPSTREAM[name]].path)]), name
        assert funnel["kept"] == _rows(shard_paths(out)) and sum(funnel["rejected"].values()) == _rows(
            rejected_paths(out)), name
        assert funnel["rejected"], f"{name} rejected nothing on a corpus made to have something to reject"
        for p in [*shard_paths(out), *rejected_paths(out)]:
            for d in read_shard(p):
                assert name in d.metadata["scores"], name
        for p in rejected_paths(out):
            for d in read_shard(p):
                assert d.metadata["rejected_by"] == name and d.metadata["reject_reason"] in funnel["rejected"]
    assert set(json.loads((Path(runs["coherence"].path) / "funnel.json").read_text())["rejected"]) <= {
        "coherence_tail"}
    # a document that survives all four carries every dimension's scores
    final = [d for p in shard_paths(runs["timeliness"].path) for d in read_shard(p)]
    assert final and all(set(DIMENSIONS) <= set(d.metadata["scores"]) for d in final)


def test_stages_that_are_off_pass_their_input_through(tmp_path: Path) -> None:
    runs = {r.stage: r for r in run_pipeline(_config(tmp_path, False), until="augment")}
    for name in DIMENSIONS:
        out, up = Path(runs[name].path), Path(runs[UPSTREAM[name]].path)
        assert runs[name].stats["enabled"] is False
        for s in input_shards(up):  # the same files (hard links), nothing rejected
            assert os.path.samefile(s.path, out / "shards" / s.name)
        assert _rows(rejected_paths(out)) == 0


@pytest.mark.parametrize("name", DIMENSIONS)
def test_an_empty_input_gives_an_empty_funnel(name: str, tmp_path: Path) -> None:
    """Every upstream document rejected: each stage still writes its funnel (all zeros), no model trained."""
    from llmpipe.curation import dimensions_config as dc
    from tests.fixtures.quality_corpus import run_stage

    edu = tmp_path / "edu.txt"
    edu.write_text("\n".join(textbook(20)) + "\n")
    cfg = {"coherence": dc.CoherenceConfig(enabled=True, reference={"en": [str(edu)]}),
           "expertise": dc.ExpertiseConfig(enabled=True, reference=[str(edu)]),
           "diversity": dc.DiversityConfig(enabled=True, max_cluster_share=0.5),
           "timeliness": dc.TimelinessConfig(enabled=True)}[name]
    if name == "coherence":
        pytest.importorskip("kenlm", reason="kenlm is not installed (pip install 'llmpipe[coherence]')")
    stats, out = run_stage(name, cfg, [], tmp_path / "run")
    assert stats["docs_in"] == stats["docs_kept"] == 0 and stats["rejected"] == {}
    assert json.loads((out / "funnel.json").read_text())["in"] == 0
