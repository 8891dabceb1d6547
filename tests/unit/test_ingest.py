import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from llmpipe.config import load_config
from llmpipe.dag import run_pipeline
from llmpipe.document import read_shard, shard_paths
from tests.conftest import write_jsonl


def _run(workdir: Path, sources: list[dict], *overrides: str):
    cfg = load_config(None, ["executor.workers=1", *overrides], data={"sources": sources})
    (ingest,) = run_pipeline(cfg, until="ingest")
    return ingest, Path(ingest.path)


def _docs(art: Path):
    return [d for p in shard_paths(art) for d in read_shard(p)]


def test_bad_records_are_quarantined_with_file_and_line(workdir: Path) -> None:
    f = write_jsonl(workdir / "data" / "mixed.jsonl", [
        {"text": "A good first document."},
        '{"text": "broken json',                    # line 2
        b'{"text": "caf\xe9 latin-1"}',             # line 3: not UTF-8
        {"text": "   "},                            # line 4: empty after strip
        {"body": "no text field"},                  # line 5
        {"text": 42},                               # line 6
        {"text": "Another fine document.", "url": "https://example.org"},
    ])
    run, art = _run(workdir, [{"name": "web", "path": str(f)}])
    s = run.stats
    assert (s["read"], s["ingested"], s["quarantined"]) == (7, 2, 5)
    assert s["read"] == s["ingested"] + s["quarantined"]
    q = [json.loads(line) for line in (art / "quarantine.jsonl").read_text().splitlines()]
    where = {x["where"].rsplit(":", 1)[1]: x["reason"] for x in q}
    assert where["2"].startswith("malformed JSON")
    assert where["3"].startswith("undecodable bytes")
    assert where["4"] == "empty text"
    assert where["5"] == "missing text field 'text'"
    assert "not a string" in where["6"]
    assert all(x["where"].startswith(str(f)) for x in q)
    docs = _docs(art)
    assert [d.text for d in docs] == ["A good first document.", "Another fine document."]
    assert docs[1].metadata["url"] == "https://example.org" and docs[1].metadata["loc"] == "7"


def test_formats_and_normalization(workdir: Path) -> None:
    d = workdir / "data"
    d.mkdir()
    line = json.dumps({"text": "ﬁne café\x07 text"}).encode() + b"\n"
    (d / "a.jsonl.gz").write_bytes(gzip.compress(line))
    (d / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(line))
    pq.write_table(pa.table({"content": ["parquet doc one", "parquet doc two"]}), d / "c.parquet")
    (d / "d.txt").write_text("a whole file\nis one document")
    run, art = _run(workdir, [{"name": "mix", "path": str(d)}], "ingest.normalization=NFKC")
    texts = sorted(x.text for x in _docs(art))
    # parquet has no 'text' column: quarantined as one unreadable file, named
    assert run.stats["quarantined"] == 1 and "no column 'text'" in (art / "quarantine.jsonl").read_text()
    assert texts == ["a whole file\nis one document", "fine café text", "fine café text"]
    run2, art2 = _run(workdir, [{"name": "pq", "path": str(d / "c.parquet"), "text_field": "content"}])
    assert sorted(x.text for x in _docs(art2)) == ["parquet doc one", "parquet doc two"]


def test_text_lines_and_hf_disk(workdir: Path) -> None:
    import datasets

    (workdir / "lines.txt").write_text("one\n\ntwo\nthree\n")
    datasets.Dataset.from_dict({"text": ["hf one", "hf two"]}).save_to_disk(str(workdir / "hf"))
    run, art = _run(workdir, [{"name": "lines", "path": "lines.txt", "format": "text_lines"},
                              {"name": "hf", "path": str(workdir / "hf")}])
    assert sorted(x.text for x in _docs(art)) == ["hf one", "hf two", "one", "three", "two"]
    assert run.stats["read"] == 5


def test_ids_are_stable_and_rerun_reuses(workdir: Path) -> None:
    f = write_jsonl(workdir / "a.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    r1, art1 = _run(workdir, [{"name": "s", "path": str(f)}])
    r2, art2 = _run(workdir, [{"name": "s", "path": str(f)}])
    assert r1.ran and not r2.ran and art1 == art2
    ids = [d.id for d in _docs(art1)]
    assert len(set(ids)) == 10


def test_new_file_only_ingests_the_new_file(workdir: Path) -> None:
    d = workdir / "src"
    write_jsonl(d / "day1.jsonl", [{"text": f"first day {i}"} for i in range(5)])
    r1, art1 = _run(workdir, [{"name": "s", "path": str(d)}])
    shard_root = workdir / ".llmpipe" / "store" / "ingest" / "_shards"
    before = set(p.name for p in shard_root.iterdir())
    write_jsonl(d / "day2.jsonl", [{"text": f"second day {i}"} for i in range(3)])
    r2, art2 = _run(workdir, [{"name": "s", "path": str(d)}])
    after = set(p.name for p in shard_root.iterdir())
    assert r2.ran and art2 != art1 and len(after - before) == 1 and before <= after
    assert r2.stats["ingested"] == 8


def test_missing_source_is_a_clear_error(workdir: Path) -> None:
    import pytest

    from llmpipe.sources import SourceError

    with pytest.raises(SourceError, match="sources.gone.path: .* does not exist"):
        _run(workdir, [{"name": "gone", "path": "nope/data.jsonl"}])


def test_big_files_split_into_chunks_keep_every_line_once(workdir: Path) -> None:
    recs: list = [{"text": f"document {i} " + "x" * (i % 50)} for i in range(500)]
    recs[321] = '{"text": broken'
    f = write_jsonl(workdir / "big.jsonl", recs)
    run, art = _run(workdir, [{"name": "s", "path": str(f)}], "ingest.chunk_mb=0.004", "executor.workers=2")
    assert run.stats["files"] > 5  # several chunks of one file
    docs = _docs(art)
    assert len(docs) == 499 and len({d.id for d in docs}) == 499
    assert sorted(int(d.metadata["loc"]) for d in docs) == [n for n in range(1, 501) if n != 322]
    q = (art / "quarantine.jsonl").read_text()
    assert f"{f}:322" in q and run.stats["read"] == 500


def test_arrow_fast_path_writes_the_same_shards_as_the_line_loop(tmp_path: Path) -> None:
    from dataclasses import replace

    from llmpipe.ingest import chunk_bounds, fast_jsonl, ingest_file
    from llmpipe.store import sha256_file
    from tests.fixtures.ingest_jobs import ingest_job

    recs = [{"text": f"Ｆｕｌｌ width {i}\x07 and café\u0301", "url": f"u{i}", "n": i, "ok": i % 2 == 0,
             "score": i / 3} for i in range(300)]
    f = write_jsonl(tmp_path / "clean.jsonl", recs)
    cfg = {"normalization": "NFKC", "strip_control": True, "min_chars": 1, "max_docs_per_shard": 128}
    job = ingest_job(f, prefix="s-clean", id_field="n", chunk=chunk_bounds(f, 3)[1], **cfg)
    fast_out, slow_out = tmp_path / "fast", tmp_path / "slow"
    assert fast_jsonl(job, fast_out) is not None
    stats = ingest_file(replace(job, fast=False), slow_out)
    fast_files = sorted(p.name for p in (fast_out / "shards").iterdir())
    assert fast_files == sorted(p.name for p in (slow_out / "shards").iterdir()) and len(fast_files) == 1
    for name in fast_files:
        assert sha256_file(fast_out / "shards" / name) == sha256_file(slow_out / "shards" / name)
    assert stats["ingested"] == len(read_shard(fast_out / "shards" / fast_files[0]))


def test_fast_path_declines_anything_unclean(tmp_path: Path) -> None:
    from llmpipe.ingest import fast_jsonl
    from tests.fixtures.ingest_jobs import ingest_job

    cfg = {"normalization": "NFC", "strip_control": True, "min_chars": 1, "max_docs_per_shard": 100}
    cases = {
        "broken": [{"text": "a"}, '{"text": oops'],
        "blank": [{"text": "a"}, "", {"text": "b"}],
        "empty": [{"text": "a"}, {"text": "  "}],
        "missing": [{"text": "a"}, {"body": "b"}],
        "nested": [{"text": "a", "meta": {"x": 1}}],
        "number": [{"text": 5}],
    }
    for name, recs in cases.items():
        f = write_jsonl(tmp_path / f"{name}.jsonl", recs)
        assert fast_jsonl(ingest_job(f, prefix=name, **cfg), tmp_path / name) is None, name


def test_planned_units_are_typed_picklable_jobs(workdir: Path, tmp_path: Path) -> None:
    """The planner hands the stage frozen ``IngestUnit``s: a chunked file gives one per chunk (in order,
    covering the file), they survive the trip to a worker process, and a misspelled field fails where
    the job is built, not as a KeyError in a worker."""
    import dataclasses
    import pickle

    import pytest

    from llmpipe.ingest import IngestJob, IngestUnit, plan_inputs

    f = write_jsonl(workdir / "data" / "big.jsonl", [{"text": f"document number {i} " * 4} for i in range(400)])
    cfg = load_config(None, ["ingest.chunk_mb=0.004"], data={"sources": [{"name": "s", "path": str(f)}]})
    units, keys = plan_inputs(cfg, tmp_path / "state")
    assert len(units) > 5 and all(type(u) is IngestUnit for u in units)
    assert units[0].chunk[0] == 0 and units[-1].chunk[1] == f.stat().st_size
    assert all(a.chunk[1] == b.chunk[0] for a, b in zip(units, units[1:], strict=False))
    assert [u.prefix[-5:] for u in units[:2]] == ["c0000", "c0001"]
    assert {u.source_key for u in units} == {keys["source:s"]}
    job = IngestJob(units[1], cfg.ingest)
    assert pickle.loads(pickle.dumps(job)) == job
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.fast = False  # type: ignore[misc]
    with pytest.raises(TypeError, match="text_feild"):
        IngestUnit(**{**dataclasses.asdict(units[0]), "text_feild": "body"})
