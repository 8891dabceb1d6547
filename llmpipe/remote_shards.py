"""Shard jobs that reach the store through its URL: a Dask worker on another host needs no shared disk.

A stage hands its shard jobs paths on the driver's disk: input artifacts (``<store.local>/<stage>/
<key>/...``), per-shard results (``<stage>/_shards/<key>``) and its own output folder (``ctx.out``, a
temporary sibling of the artifact). With a local store those paths are what every process reads.
With an fsspec URL store (``s3://bucket/llmpipe``) and an executor whose workers do not share the
driver's disk (:attr:`ShardExecutor.shares_disk` False: Dask), :class:`StoreView` goes with each job
instead, and on the worker :func:`localize` maps each driver path to the worker's own copy:

* a published artifact is downloaded into the worker's store cache and verified
  (:meth:`~llmpipe.store.ArtifactStore.get`), once per worker folder;
* a per-shard result is downloaded from ``<url>/<stage>/_shards/<key>/`` (``_DONE.json`` marks it whole);
* ``ctx.out`` becomes an empty staging folder of the job: what the job writes there is uploaded to
  ``<url>/<stage>/.tmp-job-*/`` and the driver pulls it into ``ctx.out`` (:func:`pull_staged`);
* a file on the driver's disk outside the store that a job names by a ``Path`` (ingest's source
  files) is uploaded to ``<url>/<stage>/.tmp-files-*/<its absolute path>`` while the stage's jobs run
  and downloaded once per worker folder; a ``Path`` the driver does not have as a file (a folder, a
  path on a mount every host shares) goes to the job unchanged, and so does a source given as a URL
  (a ``str``: the job opens it where it lives).

A cached shard's result is written on the worker as on the driver (temporary sibling, then rename),
uploaded file by file with ``_DONE.json`` last, and the driver downloads the shard folders the stage
reads. The same stage code runs either way, so the artifacts are byte-identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmpipe.shard_cache import DONE, run_shard_job
from llmpipe.store import SHARDS_DIR, ArtifactStore

_STORES: dict[str, ArtifactStore] = {}
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class StoreView:
    """What a shard job needs to find the driver's store from another host."""

    url: str  # the store's fsspec URL
    driver_local: str  # the driver's local view of the store (``store.local``)
    stage: str
    out: str  # the driver's ``ctx.out``
    shared: str | None = None  # remote folder of what the driver wrote into ``out`` before the jobs
    shared_paths: tuple[str, ...] = ()  # those paths, relative to ``out``
    files: str | None = None  # remote folder of the driver's files the jobs name (``<folder><abs path>``)

    @classmethod
    def of(cls, store: ArtifactStore, stage: str, out: Path) -> StoreView:
        return cls(url=store.url, driver_local=str(store.local), stage=stage, out=str(out))


def worker_store(url: str) -> ArtifactStore:
    """This worker's view of the store: downloads go to ``.llmpipe/store-cache`` in its own folder."""
    with _LOCK:
        store = _STORES.get(url)
        if store is None:
            store = _STORES[url] = ArtifactStore(url, cache_dir=Path.cwd() / ".llmpipe" / "store-cache")
        return store


def remote_shard_dir(store: ArtifactStore, stage: str, shard_key: str) -> str:
    """``<url root>/<stage>/_shards/<key>`` on the store's filesystem."""
    return f"{store.root.as_posix()}/{stage}/{SHARDS_DIR}/{shard_key}"


def fetch_shard(store: ArtifactStore, stage: str, shard_key: str) -> bool:
    """Make the per-shard result local (download it when only the remote has it); False if none has."""
    local = store.shard_cache_root(stage) / shard_key
    if (local / DONE).is_file():
        return True
    remote = remote_shard_dir(store, stage, shard_key)
    if not store.fs.exists(f"{remote}/{DONE}"):
        return False
    tmp = local.parent / f".tmp-{shard_key}-{uuid.uuid4().hex[:8]}"
    store.fs.get(remote + "/", str(tmp), recursive=True)
    try:
        tmp.rename(local)
    except OSError:  # another job of this worker fetched it first
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def put_files(store: ArtifactStore, base: Path, files: list[Path], remote: str) -> None:
    """Upload ``files`` (under ``base``) to ``remote``, each at its path relative to ``base``, in order."""
    for f in files:
        store.fs.put_file(str(f), f"{remote}/{f.relative_to(base).as_posix()}")


def push_shard(store: ArtifactStore, stage: str, shard_key: str) -> None:
    """Upload a finished per-shard result: data first, ``_DONE.json`` last (no marker, no result)."""
    local = store.shard_cache_root(stage) / shard_key
    remote = remote_shard_dir(store, stage, shard_key)
    if store.fs.exists(f"{remote}/{DONE}"):
        return
    put_files(store, local, [*sorted(f for f in local.rglob("*") if f.is_file() and f.name != DONE), local / DONE],
              remote)


class _Mapper:
    """Driver paths -> this worker's paths (fetching what they name), and back for results."""

    def __init__(self, view: StoreView, store: ArtifactStore, staging: Path | None) -> None:
        self.view, self.store, self.staging = view, store, staging
        self.driver_local = Path(view.driver_local)
        self.out = Path(view.out)

    def to_worker(self, p: str) -> str:
        path = Path(p)
        if path.is_relative_to(self.out) and path != self.out:
            rel = path.relative_to(self.out).as_posix()
            if rel in self.view.shared_paths:
                return str(_fetch_shared(self.store, self.view, rel))
        if self.staging is not None and path.is_relative_to(self.out):
            return str(self.staging / path.relative_to(self.out))
        rel = path.relative_to(self.driver_local)
        if len(rel.parts) < 2:
            raise ValueError(f"{self.view.stage}: a shard job was given the store folder {p}")
        stage, key = rel.parts[0], rel.parts[1]
        if key == SHARDS_DIR and len(rel.parts) >= 3:
            if not fetch_shard(self.store, stage, rel.parts[2]):
                raise FileNotFoundError(f"{self.view.stage}: per-shard result {stage}/{SHARDS_DIR}/"
                                        f"{rel.parts[2]} is not in the store {self.view.url}")
        elif key.startswith((".", "_")):
            raise ValueError(f"{self.view.stage}: a shard job was given {p}, a temporary folder on the "
                             "driver's disk that a worker of another host cannot read")
        elif self.store.get(stage, key) is None:
            raise FileNotFoundError(f"{self.view.stage}: artifact {stage}/{key[:12]} is not in the store "
                                    f"{self.view.url}")
        return str(self.store.local / rel)

    def file_to_worker(self, p: str) -> str:
        """A driver file outside the store (shared for the stage's jobs) -> this worker's copy of it."""
        path = Path(p)
        if self.view.files is None or path.is_relative_to(self.driver_local) or path.is_relative_to(self.out):
            return p
        remote = f"{self.view.files}{path.as_posix()}"
        local = self.store.local / self.view.stage / ".shared-files" / self.view.files.rsplit("/", 1)[-1] / \
            path.relative_to(path.anchor)
        if local.is_file():
            return str(local)
        if not self.store.fs.isfile(remote):
            return p
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".tmp-{uuid.uuid4().hex}")
        self.store.fs.get_file(remote, str(tmp))
        tmp.replace(local)
        return str(local)

    def driver_files(self, obj: Any) -> Any:
        """``obj`` with the driver's shared files (named by a ``Path``) mapped to this worker's copies."""
        return obj if self.view.files is None else walk(obj, [Path("/")], self.file_to_worker, paths_only=True)

    def to_driver(self, p: str) -> str:
        path = Path(p)
        if self.staging is not None and path.is_relative_to(self.staging):
            return str(self.out / path.relative_to(self.staging))
        return str(self.driver_local / path.relative_to(self.store.local))


def walk(obj: Any, under: list[Path], fn: Callable[[str], str], paths_only: bool = False) -> Any:
    """``obj`` with every path (str or Path; ``paths_only``: Path) under ``under`` mapped by ``fn``; a
    container is rebuilt only when something in it changed (a job's per-document lists come back as
    they were)."""
    if isinstance(obj, Path) or (isinstance(obj, str) and not paths_only):
        s = str(obj)
        if any(s == str(r) or s.startswith(str(r).rstrip("/") + "/") for r in under):
            mapped = fn(s)
            if mapped == s:
                return obj
            return Path(mapped) if isinstance(obj, Path) else mapped
        return obj
    if isinstance(obj, dict):
        items = {k: walk(v, under, fn, paths_only) for k, v in obj.items()}
        return obj if all(items[k] is v for k, v in obj.items()) else items
    if isinstance(obj, (list, tuple)):
        values = [walk(v, under, fn, paths_only) for v in obj]
        if all(a is b for a, b in zip(values, obj, strict=True)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*values)
        return type(obj)(values)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: walk(getattr(obj, f.name), under, fn, paths_only)
                   for f in dataclasses.fields(obj) if f.init}
        if all(v is getattr(obj, k) for k, v in changes.items()):
            return obj
        return dataclasses.replace(obj, **changes)
    return obj


def share_inputs(store: ArtifactStore, view: StoreView, items: list[Any]) -> StoreView:
    """Upload what the driver already wrote into ``ctx.out`` and the items name (a model the stage
    built before scoring its shards) to ``<url>/<stage>/.tmp-in-*``; the view tells the workers where.
    Call :func:`unshare_inputs` with the returned view when the jobs are done."""
    out, found = Path(view.out), set()

    def note(p: str) -> str:
        if Path(p) != out and Path(p).exists():
            found.add(Path(p).relative_to(out).as_posix())
        return p

    walk(items, [out], note)
    view = _share_driver_files(store, view, items)
    if not found:
        return view
    remote = f"{store.root.as_posix()}/{view.stage}/.tmp-in-{uuid.uuid4().hex}"
    for rel in sorted(found):
        src = out / rel
        put_files(store, out, [src] if src.is_file() else sorted(f for f in src.rglob("*") if f.is_file()), remote)
    return dataclasses.replace(view, shared=remote, shared_paths=tuple(sorted(found)))


def _share_driver_files(store: ArtifactStore, view: StoreView, items: list[Any]) -> StoreView:
    """Upload the driver's files outside the store that the items name by a ``Path`` (each once)."""
    inside = (Path(view.driver_local), Path(view.out))
    files: set[Path] = set()

    def note(p: str) -> str:
        path = Path(p)
        if not any(path.is_relative_to(r) for r in inside) and path.is_file():
            files.add(path)
        return p

    walk(items, [Path("/")], note, paths_only=True)
    if not files:
        return view
    remote = f"{store.root.as_posix()}/{view.stage}/.tmp-files-{uuid.uuid4().hex}"
    for f in sorted(files):
        store.fs.put_file(str(f), f"{remote}{f.as_posix()}")
    return dataclasses.replace(view, files=remote)


def unshare_inputs(store: ArtifactStore, view: StoreView) -> None:
    for remote in (view.shared, view.files):
        if remote is not None:
            store.fs.rm(remote, recursive=True)


@contextlib.contextmanager
def shared_view(store: ArtifactStore, stage: str, out: Path, items: list[Any]) -> Iterator[StoreView]:
    """The view a stage's jobs take to the workers, with what they read from ``out`` shared for as
    long as the block runs (:func:`share_inputs`, then :func:`unshare_inputs`, also on failure)."""
    view = share_inputs(store, StoreView.of(store, stage, out), items)
    try:
        yield view
    finally:
        unshare_inputs(store, view)


def _fetch_shared(store: ArtifactStore, view: StoreView, rel: str) -> Path:
    """This worker's copy of a driver-written input (downloaded once per worker folder and upload)."""
    assert view.shared is not None
    base = store.local / view.stage / ".shared-inputs" / view.shared.rsplit("/", 1)[-1]
    top = rel.split("/")[0]
    local = base / rel
    if not (base / top).exists():
        tmp = base.parent / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir(parents=True)
        store.fs.get(f"{view.shared}/{top}", str(tmp / top), recursive=True)
        base.mkdir(parents=True, exist_ok=True)
        try:
            (tmp / top).rename(base / top)
        except OSError:  # another job of this worker fetched it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return local


def run_remote_job(job: tuple[Callable[[Any], Any], Any, StoreView]) -> tuple[Any, str | None]:
    """One ``ctx.map`` item on a worker: (the result with driver paths, the remote staging folder or None)."""
    fn, item, view = job
    store = worker_store(view.url)
    staging = Path(tempfile.mkdtemp(prefix="llmpipe-job-"))
    try:
        m = _Mapper(view, store, staging)
        result = fn(walk(m.driver_files(item), [Path(view.driver_local), Path(view.out)], m.to_worker))
        result = walk(result, [store.local, staging], m.to_driver)
        files = sorted(f for f in staging.rglob("*") if f.is_file())
        if not files:
            return result, None
        remote = f"{store.root.as_posix()}/{view.stage}/.tmp-job-{uuid.uuid4().hex}"
        put_files(store, staging, files, remote)
        return result, remote
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def pull_staged(store: ArtifactStore, remote: str, out: Path) -> None:
    """Bring what a job wrote into ``ctx.out`` from its remote staging folder, then drop that folder."""
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-pull-", dir=out.parent))
    try:
        store.fs.get(remote + "/", str(tmp), recursive=True)
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            dest = out / f.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            f.replace(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        store.fs.rm(remote, recursive=True)


def run_remote_shard_job(job: tuple[Callable[[Any, Path], dict[str, Any]], Any, StoreView, str]) -> None:
    """One ``cached_map`` item on a worker: compute the shard here, then put it in the store."""
    fn, arg, view, shard_key = job
    store = worker_store(view.url)
    if fetch_shard(store, view.stage, shard_key):  # another worker (or an earlier run) made it
        return
    m = _Mapper(view, store, None)
    arg = walk(m.driver_files(arg), [Path(view.driver_local)], m.to_worker)
    run_shard_job((fn, arg, str(store.shard_cache_root(view.stage) / shard_key)))
    push_shard(store, view.stage, shard_key)


def done_marker(store: ArtifactStore, stage: str, shard_key: str) -> dict[str, Any]:
    """The stats of a per-shard result, fetched into the driver's cache first."""
    if not fetch_shard(store, stage, shard_key):
        raise FileNotFoundError(f"{stage}: per-shard result {shard_key} is in neither {store.local} "
                                f"nor {store.url}")
    return json.loads((store.shard_cache_root(stage) / shard_key / DONE).read_text())
