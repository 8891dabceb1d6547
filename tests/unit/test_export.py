"""The curated corpus as a dataset to take away: every document stage's ``shards/`` loads with
``datasets`` as it is, unchanged shards are hard links, and ``llmpipe export`` (the real console
script) writes Parquet and JSONL that come back through ingest with the same texts and metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmpipe.config import load_config
from llmpipe.dag import run_pipeline
from llmpipe.data.multilingual import SAMPLES
from llmpipe.document import REJECTED, SHARDS, Document, read_shard, rejected_paths, shard_paths, write_shard
from llmpipe.export import DOCUMENT_STAGES
from llmpipe.store import sha256_file
from tests.conftest import write_jsonl

EN, ZH = SAMPLES["en"], SAMPLES["zh"]
# two samples per document: Gopher's 50-word minimum; one edited word of ~130 leaves a Jaccard near 0.9
FIRST, SECOND, LONG = EN[0] + " " + EN[1], EN[2] + " " + EN[3], EN[4] + " " + EN[5]
NEAR = LONG.replace("satellites", "aircraft", 1)
ZH_DOCS = ["".join(ZH[0:3]), "".join(ZH[3:6])]
LLMPIPE = Path(sys.executable).with_name("llmpipe")  # the console script of this environment


def _config_data(root: Path) -> dict[str, Any]:
    return {
        "name": "export", "store": str(root / "store"), "state_dir": str(root / "state"),
        "sources": [{"name": "web", "path": str(root / "src"), "format": "jsonl"}],
        "executor": {"kind": "local", "workers": 1},
        "langid": {"languages": ["en", "zh"]},
        "augment": {"enabled": True, "seed": 0,
                    "operators": [{"type": "synonym", "fraction": 1.0, "probability": 0.3, "languages": ["en"]}]},
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The library pipeline up to augment on three files: English with an exact and a near duplicate
    (and nested fields), Chinese with nothing to remove, and one text every stage rejects."""
    root = tmp_path_factory.mktemp("export")
    assert NEAR != LONG
    write_jsonl(root / "src" / "a.jsonl",
                [{"text": t, "id": f"a-{i}", "page": {"url": f"https://example.org/{i}", "tags": ["x", i]}}
                 for i, t in enumerate([FIRST, LONG, SECOND, FIRST, NEAR])])
    write_jsonl(root / "src" / "b.jsonl", [{"text": t} for t in ZH_DOCS])
    # langid: too short, so every later shard of c is empty; ingest quarantines the broken line
    write_jsonl(root / "src" / "c.jsonl", [{"text": "short"}, '{"text": "broken'])
    (root / "p.yaml").write_text(yaml.safe_dump(_config_data(root)))
    runs = {r.stage: Path(r.path) for r in run_pipeline(load_config(root / "p.yaml"), until="augment")}
    return {"root": root, "art": runs}


def _rows(paths: list[Path]) -> list[tuple[str, str, str, dict]]:
    return sorted((d.id, d.text, d.source, d.metadata) for p in paths for d in read_shard(p))


def _load_parquet(folder: Path, cache: Path) -> list[tuple[str, str, str, dict]]:
    import datasets

    ds = datasets.load_dataset("parquet", data_dir=str(folder), split="train", cache_dir=str(cache))
    return sorted((r["id"], r["text"], r["source"], json.loads(r["metadata"])) for r in ds)


def _named(paths: list[Path], part: str) -> Path:
    return next(p for p in paths if part in p.name)


def test_every_document_stage_loads_with_datasets_as_it_is(corpus: dict[str, Any], tmp_path: Path) -> None:
    for stage in DOCUMENT_STAGES:
        art = corpus["art"][stage]
        expected = _rows(shard_paths(art))
        assert expected, stage
        assert _load_parquet(art / SHARDS, tmp_path / stage) == expected, stage
        if stage != "ingest":  # the file langid empties stays one (empty) shard: datasets reads it too
            assert read_shard(_named(shard_paths(art), "c.jsonl")) == [], stage


def test_dedup_shards_are_exactly_the_kept_documents(corpus: dict[str, Any], tmp_path: Path) -> None:
    safety, dedup = corpus["art"]["safety"], corpus["art"]["dedup"]
    removed = {d.id: d.metadata for p in rejected_paths(dedup) for d in read_shard(p)}
    assert {m["reject_reason"] for m in removed.values()} == {"exact_duplicate", "near_duplicate"}
    texts = {d.text for p in rejected_paths(dedup) for d in read_shard(p)}
    assert texts == {FIRST, NEAR}
    kept = [r for r in _rows(shard_paths(safety)) if r[0] not in removed]
    got = _load_parquet(dedup / SHARDS, tmp_path)
    assert got == kept and all(r[3].get("scores") for r in got)  # text and metadata, scores included
    # the Chinese shard loses nothing: it is safety's file, and a rewrite would have the same bytes
    zh = _named(shard_paths(dedup), "b.jsonl")
    assert zh.samefile(_named(shard_paths(safety), "b.jsonl"))
    write_shard(tmp_path / "again.parquet", read_shard(zh))
    assert sha256_file(tmp_path / "again.parquet") == sha256_file(zh)
    assert not _named(shard_paths(dedup), "a.jsonl").samefile(_named(shard_paths(safety), "a.jsonl"))


def test_augment_links_the_shards_it_adds_nothing_to(corpus: dict[str, Any]) -> None:
    dedup, augment = corpus["art"]["dedup"], corpus["art"]["augment"]
    en = _named(shard_paths(augment), "a.jsonl")
    assert len(read_shard(en)) > len(read_shard(_named(shard_paths(dedup), "a.jsonl")))
    for part in ("b.jsonl", "c.jsonl"):  # augment.operators take English only
        assert _named(shard_paths(augment), part).samefile(_named(shard_paths(dedup), part))


def test_a_filter_stage_without_filters_links_its_input(tmp_path: Path) -> None:
    from llmpipe.curation.config import SafetyConfig
    from llmpipe.curation.stages import FilterJob, filter_shard

    src = tmp_path / "in" / "s.parquet"
    write_shard(src, [Document("1", "some text", "t", {"lang": "en"}), Document("2", "more text", "t", {})])
    funnel = filter_shard(FilterJob("safety", str(src), SafetyConfig(filters=[])), tmp_path / "out")
    assert (tmp_path / "out" / SHARDS / "s.parquet").samefile(src)
    assert read_shard(tmp_path / "out" / REJECTED / "s.parquet") == []
    assert (funnel["in"], funnel["kept"], funnel["rejected"]) == (2, 2, {})


def test_jsonl_refuses_a_metadata_text_field_and_splices_metadata_exactly(tmp_path: Path) -> None:
    from llmpipe.export import ExportError, export_artifact, jsonl_lines

    meta = {"big": 12345678901234567890123, "f": 0.1, "nested": {"text": "inner is fine"}, "u": "ü\u2028"}
    write_shard(tmp_path / "a" / SHARDS / "s.parquet", [Document("1", "tëxt\n", "t", meta)])
    (line,) = jsonl_lines(tmp_path / "a" / SHARDS / "s.parquet")
    assert json.loads(line) == {"text": "tëxt\n", **meta}
    write_shard(tmp_path / "b" / SHARDS / "s.parquet", [Document("1", "body", "t", {"text": "a field"})])
    with pytest.raises(ExportError, match="metadata has a 'text' field"):
        export_artifact(tmp_path / "b", tmp_path / "out", "jsonl")
    assert export_artifact(tmp_path / "b", tmp_path / "out2", "parquet").kept == 1


def _llmpipe(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMPIPE_WARM": "0"}
    return subprocess.run([str(LLMPIPE), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_console_export_parquet_and_jsonl_round_trip(corpus: dict[str, Any], tmp_path: Path) -> None:
    root, dedup = corpus["root"], corpus["art"]["dedup"]
    done = _llmpipe(root, "export", "dedup", "p.yaml", "--to", str(tmp_path / "pq"))
    assert done.returncode == 0, done.stderr
    non_empty = [p for p in shard_paths(dedup) if read_shard(p)]
    assert sorted(p.name for p in (tmp_path / "pq" / "kept").iterdir()) == [p.name for p in non_empty]
    assert all(sha256_file(tmp_path / "pq" / "kept" / p.name) == sha256_file(p) for p in non_empty)
    assert _load_parquet(tmp_path / "pq" / "kept", tmp_path / "hf") == _rows(shard_paths(dedup))
    summary = json.loads((tmp_path / "pq" / "export.json").read_text())
    assert summary["stage"] == "dedup" and summary["rejected"] is None
    assert summary["kept"]["documents"] == len(_rows(shard_paths(dedup)))

    done = _llmpipe(root, "export", "dedup", "p.yaml", "--to", str(tmp_path / "js"), "--format", "jsonl",
                    "--rejected")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for p in sorted((tmp_path / "js" / "rejected").iterdir())
             for line in p.read_text().splitlines()]
    assert sorted(r["text"] for r in lines) == sorted([FIRST, NEAR])
    assert all(r["reject_reason"].endswith("_duplicate") and r["duplicate_of"] and r["scores"] for r in lines)

    # the kept JSONL read back by ingest: the same texts and metadata (nested fields and scores included)
    data = {**_config_data(tmp_path / "again"), "sources": [
        {"name": "back", "path": str(tmp_path / "js" / "kept"), "format": "jsonl"}]}
    (again,) = run_pipeline(load_config(data=data), until="ingest")
    back = sorted((d.text, json.dumps(d.metadata, sort_keys=True)) for d in
                  (d for p in shard_paths(Path(again.path)) for d in read_shard(p)))
    orig = sorted((r[1], json.dumps(r[3], sort_keys=True)) for r in _rows(shard_paths(dedup)))
    assert back == orig


def test_console_export_refuses_clearly(corpus: dict[str, Any], tmp_path: Path) -> None:
    root = corpus["root"]
    done = _llmpipe(root, "export", "ingest", "p.yaml", "--to", str(tmp_path / "ing"), "--rejected")
    assert done.returncode == 0, done.stderr
    (bad,) = [json.loads(line) for line in (tmp_path / "ing" / "quarantine.jsonl").read_text().splitlines()]
    assert bad["where"].endswith("c.jsonl:2") and "malformed JSON" in bad["reason"]
    assert json.loads((tmp_path / "ing" / "export.json").read_text())["quarantined"]["records"] == 1
    done = _llmpipe(root, "export", "tokenize", "p.yaml", "--to", str(tmp_path / "x"))
    assert done.returncode == 2 and "stage 'tokenize' does not hold documents" in done.stderr
    done = _llmpipe(root, "export", "dedup", "p.yaml", "dedup.threshold=0.9", "--to", str(tmp_path / "x"))
    assert done.returncode == 2
    assert "run `llmpipe run p.yaml dedup.threshold=0.9 --until dedup` first" in done.stderr
    assert not (tmp_path / "x").exists()
    (tmp_path / "used" / "kept").mkdir(parents=True)
    done = _llmpipe(root, "export", "safety", "p.yaml", "--to", str(tmp_path / "used"))
    assert done.returncode == 2 and "already holds kept" in done.stderr
