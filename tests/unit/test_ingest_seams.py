"""Ingest's identity and seams: ids and shard names that adding files never changes, names that cannot
collide, counts taken from the rows on disk, and files of an unknown type never skipped in silence."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from llmpipe.config import load_config
from llmpipe.dag import run_pipeline
from llmpipe.document import read_shard, shard_paths
from llmpipe.sources import SourceError
from llmpipe.store import sha256_file
from tests.conftest import write_jsonl


def _run(sources: list[dict], *overrides: str, until: str = "ingest"):
    cfg = load_config(None, ["executor.workers=1", *overrides], data={"sources": sources})
    runs = {r.stage: r for r in run_pipeline(cfg, until=until)}
    return runs["ingest"], Path(runs["ingest"].path), runs


def _ids(art: Path) -> dict[str, str]:
    """Document id -> the shard file holding it."""
    return {d.id: p.name for p in shard_paths(art) for d in read_shard(p)}


def _shard_cache(workdir: Path) -> set[str]:
    return {p.name for p in (workdir / ".llmpipe" / "store" / "ingest" / "_shards").iterdir()}


def test_adding_a_folder_beside_a_glob_keeps_every_id_shard_and_shard_key(workdir: Path) -> None:
    """``crawl/**/*.jsonl`` names files under ``crawl``, not under the common parent of today's matches
    (which was ``crawl/2024-01`` with one folder and ``crawl`` with two: every id moved)."""
    write_jsonl(workdir / "crawl" / "2024-01" / "part.jsonl", [{"text": f"january page {i}"} for i in range(6)])
    src = [{"name": "crawl", "path": "crawl/**/*.jsonl"}]
    r1, art1, _ = _run(src, until="langid")
    ids1, keys1 = _ids(art1), _shard_cache(workdir)
    shards1 = {p.name: sha256_file(p) for p in shard_paths(art1)}
    assert len(ids1) == 6 and len(keys1) == 1
    assert {d.metadata["file"] for p in shard_paths(art1) for d in read_shard(p)} == \
        {"2024-01/part.jsonl"}

    write_jsonl(workdir / "crawl" / "2024-02" / "part.jsonl", [{"text": f"february page {i}"} for i in range(4)])
    r2, art2, runs2 = _run(src, until="langid")
    ids2, keys2 = _ids(art2), _shard_cache(workdir)
    assert r2.ran and art2 != art1
    assert {i: ids2[i] for i in ids1} == ids1  # every old id, in the same shard file
    assert len(ids2) == 10
    shards2 = {p.name: sha256_file(p) for p in shard_paths(art2)}
    assert {n: shards2[n] for n in shards1} == shards1  # same names, same bytes: downstream keys hold
    assert keys1 < keys2 and len(keys2 - keys1) == 1  # the refresh computed the new file's shard only
    assert sorted(shards2) == list(shards2) and sorted(shards2)[-1] not in shards1  # new sorts last
    assert (runs2["langid"].stats["shards"], runs2["langid"].stats["shards_cached"]) == (2, 1)  # downstream too


def test_names_that_slug_alike_keep_both_files_and_counts_match_the_rows(workdir: Path) -> None:
    """``a b.jsonl`` and ``a_b.jsonl`` (byte-identical) shared a shard name: the second overwrote the
    first while the stats said 10 ingested. Both land now, and the stats are the rows on disk."""
    recs = [{"text": f"the same document {i}"} for i in range(5)]
    write_jsonl(workdir / "d" / "a b.jsonl", recs)
    write_jsonl(workdir / "d" / "a_b.jsonl", recs)
    run, art, _ = _run([{"name": "s", "path": "d"}])
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in shard_paths(art))
    assert rows == 10 and len(shard_paths(art)) == 2
    assert (run.stats["read"], run.stats["ingested"], run.stats["quarantined"]) == (10, 10, 0)
    assert len(_ids(art)) == 10  # the file's path is part of each id: same text, two ids


def test_count_check_fails_the_stage_when_rows_are_missing() -> None:
    from collections import Counter

    from llmpipe.ingest import _check_counts

    _check_counts(Counter(read=10, ingested=8, quarantined=2), on_disk=8)
    with pytest.raises(RuntimeError, match="shards hold 5 documents but the shard jobs counted 8"):
        _check_counts(Counter(read=10, ingested=8, quarantined=2), on_disk=5)
    with pytest.raises(RuntimeError, match="read 10 records but 9 are accounted"):
        _check_counts(Counter(read=10, ingested=7, quarantined=2), on_disk=7)


def test_a_file_of_unknown_type_in_a_folder_is_named_or_quarantined(workdir: Path) -> None:
    write_jsonl(workdir / "d" / "a.jsonl", [{"text": f"readable {i}"} for i in range(5)])
    (workdir / "d" / "b.jsonl.bz2").write_bytes(b"BZh91AY&SY not read")
    with pytest.raises(SourceError, match=r"sources\.s\.path: 1 file.* b\.jsonl\.bz2.*unknown_files: quarantine"):
        _run([{"name": "s", "path": "d"}])
    run, art, _ = _run([{"name": "s", "path": "d", "unknown_files": "quarantine"}])
    assert (run.stats["read"], run.stats["ingested"], run.stats["quarantined"]) == (6, 5, 1)
    (line,) = [json.loads(x) for x in (art / "quarantine.jsonl").read_text().splitlines()]
    assert line["where"].endswith("b.jsonl.bz2") and line["reason"].startswith("unknown file type")
    assert run.stats["quarantine_reasons"] == {"unknown file type": 1}


def test_compressed_text_and_ndjson_files_are_known_types(workdir: Path) -> None:
    """``.txt.gz`` / ``.md.zst`` / ``.ndjson.gz`` were skipped in silence (ingest reads them): now read."""
    import gzip

    import zstandard

    (workdir / "d").mkdir()
    (workdir / "d" / "a.txt.gz").write_bytes(gzip.compress(b"a gzipped text file"))
    (workdir / "d" / "b.md.zst").write_bytes(zstandard.ZstdCompressor().compress(b"# a zstd markdown file"))
    (workdir / "d" / "c.ndjson.gz").write_bytes(gzip.compress(b'{"text": "a gzipped ndjson line"}\n'))
    run, art, _ = _run([{"name": "s", "path": "d"}])
    assert (run.stats["read"], run.stats["ingested"]) == (3, 3)
    assert sorted(d.text for p in shard_paths(art) for d in read_shard(p)) == [
        "# a zstd markdown file", "a gzipped ndjson line", "a gzipped text file"]


def test_unknown_files_setting_is_validated() -> None:
    from llmpipe.config import ConfigError

    with pytest.raises(ConfigError, match="unknown_files"):
        load_config(None, [], data={"sources": [{"name": "s", "path": "d", "unknown_files": "skip"}]})


def test_gc_collects_shard_results_no_recorded_run_reaches_and_tmp_leftovers(workdir: Path) -> None:
    """``_shards/`` holds a second copy of the ingested corpus: gc keeps the per-shard results that a
    reached artifact lists in its manifest and collects the rest, and a killed worker's ``.tmp-*``."""
    from llmpipe.store import ArtifactStore

    f = write_jsonl(workdir / "d" / "a.jsonl", [{"text": f"old text {i}"} for i in range(3)])
    _run([{"name": "s", "path": "d"}])
    old = _shard_cache(workdir)
    for run in (workdir / ".llmpipe" / "store" / "_runs").iterdir():  # forget the first run
        run.unlink()
    write_jsonl(f, [{"text": f"new text {i}"} for i in range(3)])
    _, art, _ = _run([{"name": "s", "path": "d"}])
    new = _shard_cache(workdir) - old
    assert len(old) == len(new) == 1
    shards = workdir / ".llmpipe" / "store" / "ingest" / "_shards"
    (shards / ".tmp-killed-worker-0123abcd").mkdir()
    store = ArtifactStore(workdir / ".llmpipe" / "store")
    doomed = {Path(p).name for p, _ in store.gc(dry_run=True)}
    assert doomed >= old | {".tmp-killed-worker-0123abcd"} and not doomed & new
    store.gc(dry_run=False)
    assert _shard_cache(workdir) == new and store.get("ingest", art.name) is not None
