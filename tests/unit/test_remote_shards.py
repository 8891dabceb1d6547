"""Shard jobs that reach a URL store by its URL (``llmpipe.remote_shards``), run in-process here.

The "worker" is this process with another working folder, so its store cache is a different folder
from the driver's; the store is fsspec's ``memory://`` filesystem (one per process, which is enough
in-process). The Dask path over a real S3 server is ``tests/flows/test_dask_scheduler.py``.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from llmpipe.remote_shards import (
    StoreView,
    fetch_shard,
    pull_staged,
    run_remote_job,
    run_remote_shard_job,
    share_inputs,
    unshare_inputs,
)
from llmpipe.shard_cache import DONE
from llmpipe.store import ArtifactStore


def _store(tmp: Path) -> ArtifactStore:
    store = ArtifactStore(f"memory://rs-{uuid.uuid4().hex[:8]}/store", cache_dir=tmp / "driver-cache")
    src = tmp / "src"
    (src / "shards").mkdir(parents=True)
    (src / "shards" / "a.txt").write_text("alpha\nbeta\n")
    store.publish("up", "u" * 64, src, version="1", config={}, inputs={}, stats={}, started=time.time())
    return store


def _upper(item: tuple[str, str, str]) -> dict[str, str]:
    """Read an input file and a driver-written model, write into the stage's output folder."""
    src, model, out = item
    text = Path(src).read_text().upper() + Path(model).read_text()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "a.txt").write_text(text)
    return {"wrote": str(Path(out) / "a.txt"), "read": src}


def _count(arg: str, out: Path) -> dict[str, int]:
    lines = Path(arg).read_text().splitlines()
    (out / "n.txt").write_text(str(len(lines)))
    return {"lines": len(lines)}


@pytest.fixture
def worker_home(tmp_path: Path) -> Path:
    home = tmp_path / "worker"
    home.mkdir()
    return home


def test_map_job_reads_and_writes_through_the_store(tmp_path: Path, worker_home: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    out = store.new_tmp_dir("st", "k" * 64)
    (out / "models").mkdir()
    (out / "models" / "m.txt").write_text("model")  # written by the stage before its shard jobs
    src = str(store.path("up", "u" * 64) / "shards" / "a.txt")
    items = [(src, str(out / "models" / "m.txt"), str(out / "shards"))]
    view = share_inputs(store, StoreView.of(store, "st", out), items)
    assert view.shared_paths == ("models/m.txt",)
    monkeypatch.chdir(worker_home)
    result, staged = run_remote_job((_upper, items[0], view))
    unshare_inputs(store, view)
    assert not store.fs.exists(view.shared)
    # the job read the worker's own copies, and its result names the driver's paths
    assert result == {"wrote": str(out / "shards" / "a.txt"), "read": src}
    assert (worker_home / ".llmpipe" / "store-cache" / "up" / ("u" * 64) / "shards" / "a.txt").is_file()
    assert not (out / "shards").exists()  # written on the worker only, until pulled
    pull_staged(store, staged, out)
    assert (out / "shards" / "a.txt").read_text() == "ALPHA\nBETA\nmodel"
    assert not store.fs.exists(staged)


def test_driver_temp_path_fails_with_a_clear_error(tmp_path: Path, worker_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    other = store.new_tmp_dir("other", "o" * 64)
    (other / "x.txt").write_text("x")
    out = store.new_tmp_dir("st", "k" * 64)
    view = StoreView.of(store, "st", out)
    monkeypatch.chdir(worker_home)
    with pytest.raises(ValueError, match="temporary folder on the driver's disk"):
        run_remote_job((_upper, (str(other / "x.txt"), str(other / "x.txt"), str(out)), view))


def test_cached_shard_goes_to_the_store_and_back(tmp_path: Path, worker_home: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    out = store.new_tmp_dir("st", "k" * 64)
    view = StoreView.of(store, "st", out)
    src = str(store.path("up", "u" * 64) / "shards" / "a.txt")
    assert not fetch_shard(store, "st", "s1")
    monkeypatch.chdir(worker_home)
    run_remote_shard_job((_count, src, view, "s1"))
    remote = f"{store.root.as_posix()}/st/_shards/s1"
    assert sorted(Path(f).name for f in store.fs.find(remote)) == [DONE, "n.txt"]
    assert fetch_shard(store, "st", "s1")  # the driver's cache, not the worker's
    local = tmp_path / "driver-cache" / "st" / "_shards" / "s1"
    assert (local / "n.txt").read_text() == "2" and json.loads((local / DONE).read_text())["lines"] == 2


def test_walk_maps_paths_in_containers_and_keeps_the_rest() -> None:
    import dataclasses
    from typing import NamedTuple

    from llmpipe.remote_shards import walk

    @dataclasses.dataclass(frozen=True)
    class Job:
        src: Path
        names: list[str]

    class Pair(NamedTuple):
        a: str
        b: int

    scores = [{"x": 1.0}] * 3
    obj = {"job": Job(Path("/d/s/a.txt"), ["/d/s/b", "/dx/c"]), "pair": Pair("/d/s", 2), "scores": scores}
    out = walk(obj, [Path("/d/s")], lambda p: p.replace("/d/s", "/w"))
    assert out["job"] == Job(Path("/w/a.txt"), ["/w/b", "/dx/c"]) and out["pair"] == Pair("/w", 2)
    assert out["scores"] is scores  # nothing to map: the very same list, not a copy
    assert walk(scores, [Path("/d/s")], str.upper) is scores
