"""Sources given as fsspec URLs (issue 30, item 7): listed where they live, read by the shard jobs
through the URL, and giving the bytes of a local run of the same files. ``memory://`` stands for an
object store here (the shard jobs run in this process: ``executor.workers=1``)."""

import gzip
import hashlib
import json
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmpipe.config import load_config
from llmpipe.dag import run_pipeline
from llmpipe.ingest import plan_inputs
from llmpipe.sources import SourceError, check_sources

FILES: dict[str, bytes] = {
    "2024-01/part.jsonl": "".join(json.dumps({"text": f"january page {i}", "n": i}) + "\n" for i in range(7)).encode(),
    "2024-01/crlf.jsonl": b'{"text": "windows line"}\r\n{"text": "and another", "tag": [1, 2]}\r\n',
    "2024-02/part.jsonl.gz": gzip.compress(b'{"text": "gzipped february"}\n{"text": "second"}\n'),
    "2024-02/notes.txt": b"a plain text file\nof two lines",
}


def _parquet() -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": ["a parquet row", "another row"], "lang": ["en", "en"]}), sink)
    return sink.getvalue().to_pybytes()


def _put(fs_root: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        with fsspec.open(f"{fs_root}/{rel}", "wb", auto_mkdir=True) as f:
            f.write(data)


def _run(path: str, *overrides: str, **src: str):
    cfg = load_config(None, ["executor.workers=1", *overrides], data={"sources": [{"name": "web", "path": path, **src}]})
    (run,) = run_pipeline(cfg, until="ingest")
    return run, Path(run.path)


def _artifact(art: Path) -> dict[str, str]:
    """Every file of an artifact but its manifest (timings, keys) -> sha256."""
    return {f.relative_to(art).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(art.rglob("*")) if f.is_file() and f.name != "manifest.json"}


@pytest.fixture
def bucket() -> str:
    """A fresh ``memory://`` folder, removed afterwards."""
    root = f"memory://bucket-{uuid.uuid4().hex[:8]}"
    yield root
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


@pytest.mark.parametrize(("pattern", "docs"), [("crawl/**/*", 14), ("crawl", 14), ("crawl/2024-01/part.jsonl", 7)])
def test_a_url_source_gives_the_bytes_of_the_same_files_on_disk(workdir: Path, bucket: str, pattern: str,
                                                                docs: int) -> None:
    files = {**FILES, "2024-02/table.parquet": _parquet()}
    _put(str(workdir / "crawl"), files)
    _put(f"{bucket}/crawl", files)
    local_run, local = _run(pattern)
    url_run, remote = _run(f"{bucket}/{pattern}")
    assert url_run.key != local_run.key  # keyed by the store's checksums, not by sha256 of the bytes
    assert _artifact(remote) == _artifact(local) and "shards" in {p.split("/")[0] for p in _artifact(local)}
    for k in ("read", "ingested", "quarantined"):
        assert url_run.stats[k] == local_run.stats[k]
    assert url_run.stats["ingested"] == docs


def test_url_units_carry_the_url_and_local_units_a_path(workdir: Path, bucket: str) -> None:
    _put(f"{bucket}/crawl", FILES)
    _put(str(workdir / "crawl"), FILES)
    data = {"sources": [{"name": "web", "path": f"{bucket}/crawl/**/*.jsonl*"}, {"name": "disk", "path": "crawl"}]}
    cfg = load_config(None, [], data=data)
    units, keys = plan_inputs(cfg, workdir / "state")
    web = [u for u in units if u.source == "web"]
    assert [u.rel for u in web] == ["2024-01/crlf.jsonl", "2024-01/part.jsonl", "2024-02/part.jsonl.gz"]
    assert all(isinstance(u.path, str) and u.path == f"{bucket}/crawl/{u.rel}" and u.chunk is None for u in web)
    assert all(u.display == u.path and u.sha256.startswith("fsspec:") for u in web)
    assert all(isinstance(u.path, Path) for u in units if u.source == "disk")
    assert set(keys) == {"source:web", "source:disk"}


def test_changing_one_remote_file_reingests_that_file_only(workdir: Path, bucket: str) -> None:
    _put(f"{bucket}/crawl", FILES)
    shards = workdir / ".llmpipe" / "store" / "ingest" / "_shards"
    _, art1 = _run(f"{bucket}/crawl/**/*.jsonl")
    before = {p.name for p in shards.iterdir()}
    again, art2 = _run(f"{bucket}/crawl/**/*.jsonl")
    assert not again.ran and art2 == art1  # nothing changed: the same key, nothing read
    _put(f"{bucket}/crawl", {"2024-01/part.jsonl": b'{"text": "rewritten"}\n'})
    run, art3 = _run(f"{bucket}/crawl/**/*.jsonl")
    new = {p.name for p in shards.iterdir()} - before
    assert run.ran and len(new) == 1 and run.stats["ingested"] == 3
    assert "rewritten" in pq.read_table(art3 / "shards").column("text").to_pylist()


def test_bad_url_sources_are_named(workdir: Path, bucket: str) -> None:
    _put(f"{bucket}/crawl", {**FILES, "old/a.jsonl": b'{"text": "readable"}\n', "old/b.jsonl.bz2": b"BZh91AY&SY", "bad/x.jsonl": b'{"text": "ok"}\n{oops\n'})
    _put(bucket, {"hf/dataset_info.json": b"{}", "hf/data-00000-of-00001.arrow": b""})
    for path, message in [(f"{bucket}/crawl/**/*.csv", f"sources.web.path: no files match '{bucket}/crawl/\\*\\*/\\*.csv'"),
                          (f"{bucket}/nowhere", f"sources.web.path: {bucket}/nowhere does not exist"),
                          (f"{bucket}/crawl/old", r"1 file.* b\.jsonl\.bz2.*unknown_files: quarantine"),
                          (f"{bucket}/hf", f"sources.web.path: {bucket}/hf is a `save_to_disk` folder"),
                          ("nosuchprotocol://x/y.jsonl", "sources.web.path: cannot open 'nosuchprotocol://x/y.jsonl'")]:
        cfg = load_config(None, [], data={"sources": [{"name": "web", "path": path}]})
        with pytest.raises(SourceError, match=message):
            check_sources(cfg)
    run, art = _run(f"{bucket}/crawl/old", unknown_files="quarantine")
    (line,) = [json.loads(x) for x in (art / "quarantine.jsonl").read_text().splitlines()]
    assert line["where"] == f"{bucket}/crawl/old/b.jsonl.bz2" and line["reason"].startswith("unknown file type")
    run, art = _run(f"{bucket}/crawl/bad/*.jsonl")
    (line,) = [json.loads(x) for x in (art / "quarantine.jsonl").read_text().splitlines()]
    assert line["where"] == f"{bucket}/crawl/bad/x.jsonl:2" and line["reason"].startswith("malformed JSON")
    assert (run.stats["read"], run.stats["ingested"], run.stats["quarantined"]) == (2, 1, 1)


def test_a_url_unit_goes_to_a_worker_as_its_url(tmp_path: Path, workdir: Path, bucket: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With a URL store and workers on other hosts, a URL source's files are not uploaded through the
    store (as the driver's local source files are): the worker opens the URL itself."""
    from llmpipe.ingest import IngestJob, ingest_file
    from llmpipe.remote_shards import StoreView, fetch_shard, run_remote_shard_job, share_inputs
    from llmpipe.store import ArtifactStore

    _put(f"{bucket}/crawl", FILES)
    cfg = load_config(None, [], data={"sources": [{"name": "web", "path": f"{bucket}/crawl/**/*.jsonl"}]})
    units, _ = plan_inputs(cfg, workdir / "state")
    store = ArtifactStore(f"{bucket}/store", cache_dir=tmp_path / "driver-cache")
    jobs = [IngestJob(u, cfg.ingest) for u in units]
    view = share_inputs(store, StoreView.of(store, "ingest", store.new_tmp_dir("ingest", "k" * 64)), jobs)
    assert view.files is None and view.shared is None  # nothing of the driver's disk to share
    (tmp_path / "worker").mkdir()
    monkeypatch.chdir(tmp_path / "worker")
    assert jobs[1].unit.rel == "2024-01/part.jsonl"
    run_remote_shard_job((ingest_file, jobs[1], view, "s1"))
    assert fetch_shard(store, "ingest", "s1")
    done = json.loads((tmp_path / "driver-cache" / "ingest" / "_shards" / "s1" / "_DONE.json").read_text())
    assert (done["read"], done["ingested"]) == (7, 7)


def test_url_files_are_dated_by_their_store(workdir: Path, bucket: str) -> None:
    """timeliness' ``file_mtime`` takes a URL file's modified time from its filesystem."""
    import datetime as dt

    from llmpipe.curation.timeliness import source_mtimes

    _put(f"{bucket}/crawl", FILES)
    cfg = load_config(None, [], data={"sources": [{"name": "web", "path": f"{bucket}/crawl/**/*.txt"}]})
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert list(source_mtimes(cfg).values()) == [today]


def test_a_url_file_larger_than_a_chunk_gives_the_local_runs_chunked_shards(workdir: Path, bucket: str) -> None:
    """A local file larger than ``ingest.chunk_mb`` is cut into chunk jobs (``<prefix>-c0000-...``); the
    URL file's one job finds the same cuts in its stream and writes the same shards, bad lines too."""
    lines = [json.dumps({"text": f"page {i} " + "word " * (i % 7), "n": i}) for i in range(60)]
    lines[23] = '{"text": "broken'  # a quarantined line in the middle chunk
    files = {"big.jsonl": ("\n".join(lines) + "\n").encode(), "crlf.jsonl": b'{"text": "x"}\r\n' * 80}
    _put(str(workdir / "crawl"), files)
    _put(f"{bucket}/crawl", files)
    chunk = "ingest.chunk_mb=0.001"  # about 1 kB: big.jsonl is cut in 3, crlf.jsonl in 2
    local_run, local = _run("crawl/*.jsonl", chunk)
    url_run, remote = _run(f"{bucket}/crawl/*.jsonl", chunk)
    shards = sorted(p.name for p in (local / "shards").iterdir())
    assert sum("-c0002-" in n for n in shards) == 1 and sum("-c0001-" in n for n in shards) == 2
    assert local_run.stats["files"] == 5 and url_run.stats["files"] == 2  # chunk jobs vs whole-file jobs
    want, got = _artifact(local), _artifact(remote)
    assert want.pop("quarantine.jsonl") and got.pop("quarantine.jsonl") and got == want
    q_local = [json.loads(x) for x in (local / "quarantine.jsonl").read_text().splitlines()]
    q_url = [json.loads(x) for x in (remote / "quarantine.jsonl").read_text().splitlines()]
    assert [q["reason"] for q in q_url] == [q["reason"] for q in q_local] and len(q_url) == 1
    assert q_url[0]["where"] == f"{bucket}/crawl/big.jsonl:24"
    assert q_local[0]["where"] == f"{workdir / 'crawl' / 'big.jsonl'}:24"
    for k in ("read", "ingested", "quarantined", "quarantine_reasons"):
        assert url_run.stats[k] == local_run.stats[k]
