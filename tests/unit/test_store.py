import json
import logging
from pathlib import Path

import pytest

from llmpipe.store import ArtifactStore, hash_json, stage_key


def _publish(store: ArtifactStore, stage: str, key: str, files: dict[str, str], inputs=None):
    tmp = store.new_tmp_dir(stage, key)
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    return store.publish(stage, key, tmp, version="1", config={"a": 1}, inputs=inputs or {},
                         stats={"n": len(files)}, started=0.0)


def test_key_is_canonical_and_sensitive() -> None:
    assert hash_json({"a": 1, "b": [1, 2]}) == hash_json({"b": [1, 2], "a": 1})
    k = stage_key("s", "1", {"x": 1}, {"up": "k1"})
    assert k != stage_key("s", "2", {"x": 1}, {"up": "k1"})
    assert k != stage_key("s", "1", {"x": 2}, {"up": "k1"})
    assert k != stage_key("s", "1", {"x": 1}, {"up": "k2"})


def test_publish_writes_manifest_with_hashes(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    art = _publish(store, "s", "k" * 64, {"a.txt": "hello", "d/b.txt": "world"})
    mf = json.loads((art.path / "manifest.json").read_text())
    assert set(mf["files"]) == {"a.txt", "d/b.txt"}
    assert mf["files"]["a.txt"]["bytes"] == 5 and len(mf["files"]["a.txt"]["sha256"]) == 64
    assert mf["stats"] == {"n": 2} and "python" in mf["versions"]
    assert store.get("s", "k" * 64) is not None
    assert not list((tmp_path / "store" / "s").glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["edit", "truncate", "delete"])
def test_damaged_artifact_is_not_trusted(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    store = ArtifactStore(tmp_path / "store")
    art = _publish(store, "s", "a" * 64, {"data.txt": "0123456789"})
    assert store.get("s", "a" * 64) is not None  # stamps the fast path
    f = art.path / "data.txt"
    if damage == "edit":
        f.write_text("0123456780")  # same size: only the hash can tell
    elif damage == "truncate":
        f.write_text("01234")
    else:
        f.unlink()
    with caplog.at_level(logging.WARNING, logger="llmpipe.store"):
        assert store.get("s", "a" * 64) is None
    assert "data.txt" in caplog.text


def test_touch_does_not_invalidate(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    art = _publish(store, "s", "b" * 64, {"data.txt": "same"})
    (art.path / "data.txt").touch()
    assert store.get("s", "b" * 64) is not None


def test_no_manifest_no_artifact(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    d = store.path("s", "c" * 64)
    d.mkdir(parents=True)
    (d / "half.txt").write_text("half written")
    assert store.get("s", "c" * 64) is None


def test_lineage_and_gc(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    a = _publish(store, "ingest", "1" * 64, {"x": "1"}, inputs={"source:web": "f" * 64})
    b = _publish(store, "langid", "2" * 64, {"x": "2"}, inputs={"ingest": a.key})
    orphan = _publish(store, "langid", "3" * 64, {"x": "3"}, inputs={"ingest": a.key})
    chain = store.lineage("langid", b.key)
    assert [n["stage"] for n in chain] == ["langid", "ingest", "source:web"]
    assert store.find(str(b.path)) == ("langid", b.key) and store.find("langid/2222") == ("langid", b.key)
    store.record_run({"artifacts": {"langid": b.key}})
    leftover = store.new_tmp_dir("langid", "4" * 64)  # a killed run's temporary folder
    dry = store.gc(dry_run=True)
    assert {Path(p).name for p, _ in dry} == {orphan.key, leftover.name}
    assert orphan.path.exists()
    store.gc(dry_run=False)
    assert not orphan.path.exists() and not leftover.exists() and b.path.exists() and a.path.exists()


def test_fsspec_remote_root_roundtrip(tmp_path: Path) -> None:
    import fsspec

    store = ArtifactStore("memory://llmpipe-test-store", cache_dir=tmp_path / "cache")
    art = _publish(store, "s", "d" * 64, {"f.txt": "remote"})
    fs = fsspec.filesystem("memory")
    assert fs.exists("/llmpipe-test-store/s/" + "d" * 64 + "/manifest.json")
    # a second machine: empty local cache, same remote root
    other = ArtifactStore("memory://llmpipe-test-store", cache_dir=tmp_path / "cache2")
    got = other.get("s", art.key)
    assert got is not None and (got.path / "f.txt").read_text() == "remote"


def test_a_second_publish_of_a_key_keeps_the_first_artifact_readable(tmp_path: Path) -> None:
    """Publishing a key that is already there (two flow runs of the same key) keeps the verified artifact
    and discards the new copy: a reader of the first never finds a file missing (remove-then-rename
    pulled them away). Publishers race in threads while a reader checks every file of the first."""
    import threading

    store = ArtifactStore(tmp_path / "store")
    files = {f"part-{i}.txt": f"payload {i}" * 50 for i in range(8)}
    first = _publish(store, "s", "e" * 64, files)
    inode = (first.path / "part-0.txt").stat().st_ino
    missing: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            missing.extend(rel for rel in files if not (first.path / rel).is_file())

    def publish_again(n: int) -> None:
        for _ in range(n):
            again = _publish(store, "s", "e" * 64, files)
            assert again.path == first.path and again.manifest["created"] == first.manifest["created"]

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=publish_again, args=(10,)) for _ in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert not missing
    assert (first.path / "part-0.txt").stat().st_ino == inode  # the very same files
    assert not list((tmp_path / "store" / "s").glob(".tmp-*"))  # each discarded copy is gone


def test_publish_replaces_a_copy_that_no_longer_verifies(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    first = _publish(store, "s", "f" * 64, {"data.txt": "good bytes"})
    (first.path / "data.txt").write_text("bad  bytes")  # same size, other content
    second = _publish(store, "s", "f" * 64, {"data.txt": "good bytes"})
    assert (second.path / "data.txt").read_text() == "good bytes" and store.get("s", "f" * 64) is not None
    assert not list((tmp_path / "store" / "s").glob(".tmp-*"))


def test_gc_keeps_every_shard_result_of_a_stage_with_an_artifact_from_before_the_list(tmp_path: Path) -> None:
    """A reached artifact published before manifests listed their per-shard results may use any of its
    stage's ``_shards/``: gc keeps them all (and still collects ``.tmp-*`` leftovers)."""
    store = ArtifactStore(tmp_path / "store")
    tmp = store.new_tmp_dir("s", "9" * 64)
    (tmp / "x").write_text("x")
    art = store.publish("s", "9" * 64, tmp, version="1", config={}, inputs={}, stats={}, started=0.0,
                        shards=["used"])
    root = store.shard_cache_root("s")
    for name in ("used", "unused", ".tmp-used-killed"):
        (root / name).mkdir()
    store.record_run({"artifacts": {"s": art.key}})
    assert {Path(p).name for p, _ in store.gc()} == {"unused", ".tmp-used-killed"}
    mf = json.loads((art.path / "manifest.json").read_text())
    del mf["shard_cache"]
    (art.path / "manifest.json").write_text(json.dumps(mf))
    assert {Path(p).name for p, _ in store.gc()} == {".tmp-used-killed"}


def test_gc_of_a_remote_root_collects_what_no_machine_reaches_there(tmp_path: Path) -> None:
    """A shared remote root: gc sees the runs every machine recorded (``<root>/_runs``), keeps what they
    reach, and collects unreached artifacts, unused ``_shards/`` results and ``.tmp-*`` uploads of a
    killed driver or worker on the remote itself, not only in this machine's cache."""
    import fsspec

    url = f"memory://gc-remote-{tmp_path.name}"
    fs, base = fsspec.core.url_to_fs(url)
    one = ArtifactStore(url, cache_dir=tmp_path / "one")
    used_ingest = _publish(one, "ingest", "1" * 64, {"x": "1"})
    tmp = one.new_tmp_dir("langid", "2" * 64)
    (tmp / "y").write_text("2")
    kept = one.publish("langid", "2" * 64, tmp, version="1", config={}, inputs={"ingest": used_ingest.key},
                       stats={}, started=0.0, shards=["used"])
    orphan = _publish(one, "langid", "3" * 64, {"z": "3"})
    one.record_run({"artifacts": {"langid": kept.key}})
    for name in ("used", "unused", ".tmp-killed-worker"):
        fs.pipe(f"{base}/langid/_shards/{name}/part.parquet", b"rows")
    fs.pipe(f"{base}/langid/.tmp-job-dead/out.json", b"{}")
    fs.pipe(f"{base}/langid/.tmp-in-dead/models/en.arpa", b"lm")

    other = ArtifactStore(url, cache_dir=tmp_path / "other")  # another machine: an empty cache
    dry = {p for p, _ in other.gc(dry_run=True)}
    assert dry == {f"{url}/langid/{orphan.key}", f"{url}/langid/_shards/unused",
                   f"{url}/langid/_shards/.tmp-killed-worker", f"{url}/langid/.tmp-job-dead",
                   f"{url}/langid/.tmp-in-dead"}
    assert fs.exists(f"{base}/langid/{orphan.key}/manifest.json")
    assert not (tmp_path / "other" / "langid" / kept.key).exists()  # manifests read, no artifact fetched
    other.gc(dry_run=False)
    assert not fs.exists(f"{base}/langid/{orphan.key}") and not fs.exists(f"{base}/langid/.tmp-job-dead")
    assert not fs.exists(f"{base}/langid/_shards/unused") and fs.exists(f"{base}/langid/_shards/used/part.parquet")
    assert other.get("langid", kept.key) is not None and other.get("ingest", used_ingest.key) is not None
    assert {p for p, _ in other.gc(dry_run=True)} == set()


def test_gc_keeps_a_running_runs_work_and_forgets_a_killed_one(tmp_path: Path) -> None:
    """A run records itself when it starts: a gc meanwhile keeps the artifacts it plans (published before
    its final record), its stages' per-shard results and temporary folders. Once the process is gone
    (a run killed mid-way), the record protects nothing and gc removes it."""
    import subprocess
    import sys

    store = ArtifactStore(tmp_path / "store")
    early = _publish(store, "ingest", "1" * 64, {"x": "1"})  # published by the run, not yet recorded
    (store.shard_cache_root("langid") / "in-progress").mkdir()
    leftover = store.new_tmp_dir("langid", "2" * 64)
    with store.running("data_refresh", {"ingest": early.key, "langid": "2" * 64}) as begun:
        assert store.gc(dry_run=False) == [] and early.path.exists() and leftover.exists()
        # the same record from a process that has ended: a killed run
        child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True, check=True)
        record = json.loads(begun.read_text())
        begun.write_text(json.dumps({**record, "pid": int(child.stdout), "pid_started": None}))
        doomed = {Path(p).name for p, _ in store.gc(dry_run=True)}
        assert doomed == {early.key, "in-progress", leftover.name, begun.name}
        store.record_run({"flow": "data_refresh", "artifacts": {"ingest": early.key}}, replace=begun)
    assert {Path(p).name for p, _ in store.gc(dry_run=True)} == {"in-progress", leftover.name}
    assert json.loads(begun.read_text())["artifacts"] == {"ingest": early.key}


def test_a_failed_run_leaves_no_record(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    with pytest.raises(RuntimeError), store.running("lifecycle", {"ingest": "1" * 64}):
        raise RuntimeError("a stage failed")
    assert not list((tmp_path / "store" / "_runs").glob("*.json"))
