"""A source in S3 read where it lives (issue 30): ``sources[].path: s3://llmpipe/crawl/**/*`` on a real
S3-compatible server (moto's ``moto_server``), ingested by a separately started Dask scheduler and two
workers into an S3 store. The workers open the source URLs themselves (nothing uploaded for them, no
shared disk), and the ingest artifact holds the bytes of a local run of the same files on disk, also
for a file larger than ``ingest.chunk_mb`` (range reads of S3 objects)."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from tests.flows.test_dask_scheduler import _survivors, s3_server  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

FILES = {
    "2024-01/part.jsonl": "".join(json.dumps({"text": f"january page {i}", "n": i}) + "\n" for i in range(40)).encode(),
    "2024-01/crlf.jsonl": b'{"text": "windows line"}\r\n{"text": "and another", "tag": [1, 2]}\r\n',
    "2024-02/part.jsonl.gz": gzip.compress(b'{"text": "gzipped february"}\n{"text": "second"}\n'),
    "2024-02/notes.txt": b"a plain text file\nof two lines",
}


def _ingest(pattern: str, store: str, state: Path, *overrides: str):
    from llmpipe.config import load_config
    from llmpipe.dag import run_pipeline

    cfg = load_config(None, [f"store={store}", f"state_dir={state}", "ingest.chunk_mb=0.001", *overrides],
                      data={"sources": [{"name": "web", "path": pattern}]})
    (run,) = run_pipeline(cfg, until="ingest")
    return run


def test_an_s3_source_is_read_by_the_workers_where_it_lives(tmp_path: Path, s3_server: str) -> None:  # noqa: F811
    import fsspec

    from llmpipe.executor_dask import dask_processes

    fs = fsspec.filesystem("s3")
    for rel, data in FILES.items():
        (tmp_path / "crawl" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "crawl" / rel).write_bytes(data)
        fs.pipe(f"llmpipe/crawl/{rel}", data)
    local = _ingest(str(tmp_path / "crawl" / "**" / "*"), str(tmp_path / "store"), tmp_path / "state",
                    "executor.workers=1")
    art = Path(local.path)
    want = {f.relative_to(art).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in art.rglob("*") if f.is_file() and f.name != "manifest.json"}
    cluster = tmp_path / "cluster"
    with dask_processes(cluster, n_workers=2) as address:
        run = _ingest(f"{s3_server}/crawl/**/*", f"{s3_server}/store", tmp_path / "state-dask",
                      "executor.kind=dask", f"executor.dask_address={address}")
        first = set(fs.glob("llmpipe/store/ingest/_shards/*/_DONE.json"))
        fs.pipe("llmpipe/crawl/2024-01/crlf.jsonl", b'{"text": "rewritten"}\n')  # a new upload: a new ETag
        again = _ingest(f"{s3_server}/crawl/**/*", f"{s3_server}/store", tmp_path / "state-dask",
                        "executor.kind=dask", f"executor.dask_address={address}")
    assert not _survivors(cluster), _survivors(cluster)
    assert run.ran and run.stats["ingested"] == local.stats["ingested"] == 45
    base = f"llmpipe/store/ingest/{run.key}"
    got = {f[len(base) + 1:]: hashlib.sha256(fs.cat_file(f)).hexdigest()
           for f in fs.find(base) if not f.endswith("/manifest.json")}
    assert got == want and any(k.startswith("shards/") for k in got)
    assert any("-c0001-" in k for k in got)  # part.jsonl (1.6 kB) was cut at the local run's place
    # the workers read the URLs: no source file went through the store or into a worker's cache
    assert not [p for p in fs.find("llmpipe/store") if "/.tmp-" in p]
    assert not list(cluster.glob("worker-*/.llmpipe/store-cache/ingest/.shared-files"))
    assert len(first) == len(FILES)
    assert again.ran and again.stats["ingested"] == 44  # that file alone was read again
    fs.invalidate_cache()
    assert len(set(fs.glob("llmpipe/store/ingest/_shards/*/_DONE.json")) - first) == 1


def test_an_s3_files_identity_is_its_etag(tmp_path: Path, s3_server: str) -> None:  # noqa: F811
    """Keyed without a download: the listing's ETag (the MD5 of a single-part object) and the size."""
    import fsspec

    from llmpipe.config import load_config
    from llmpipe.sources import url_files
    from llmpipe.store import hash_json

    fs = fsspec.filesystem("s3")
    fs.pipe("llmpipe/one/a.jsonl", b'{"text": "a"}\n')
    cfg = load_config(None, [], data={"sources": [{"name": "web", "path": f"{s3_server}/one/*.jsonl"}]})
    ((url, fmt, rel, ident),) = url_files(cfg.sources[0])
    etag = fs.info("llmpipe/one/a.jsonl")["ETag"]
    assert etag.strip('"') == hashlib.md5(b'{"text": "a"}\n').hexdigest()
    assert (url, fmt, rel, ident) == (f"{s3_server}/one/a.jsonl", "jsonl", "a.jsonl",
                                      "fsspec:" + hash_json([f"ETag:{etag}", 14]))
    # another client's upload (this process's cached listing knows nothing of it) changes the identity
    fsspec.filesystem("s3", skip_instance_cache=True).pipe("llmpipe/one/a.jsonl", b'{"text": "b"}\n')
    ((_, _, _, ident2),) = url_files(cfg.sources[0])
    assert ident2 != ident
