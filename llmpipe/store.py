"""The content-addressed artifact store.

Every stage's output lives at ``<root>/<stage>/<key>/`` where ``key`` hashes the stage name, the
stage's code version, its canonical config and its inputs' keys (content keys, never paths). An
artifact is written into a temporary sibling and renamed into place; ``manifest.json`` is written
last and lists every file with its sha256 and size. No manifest means no artifact, and an artifact
whose files no longer match their manifest is recomputed, never trusted.

The root is a local path or an fsspec URL (``s3://bucket/llmpipe``, ``memory://x``). Remote roots
are written by uploading a finished local directory and read through a local cache, because the
stages (torch, tokenizers, Triton) want real files.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata as _md
from pathlib import Path
from typing import Any

log = logging.getLogger("llmpipe.store")

MANIFEST = "manifest.json"
RUNS = "_runs"
RUNNING = "running"  # a run record's status until the run's final record replaces it
RUNNING_TRUST_S = 7 * 24 * 3600  # a running record from another host protects its work this long
SHARDS_DIR = "_shards"  # per-shard results reused across runs (``shard_cache_root``)
SHARD_CACHE = "shard_cache"  # the manifest's list of the per-shard results an artifact was made from
_VERSIONED_LIBS = ("llmpipe", "torch", "transformers", "tokenizers", "datasketch", "pyarrow", "numpy",
                   "deepspeed", "llmcompressor", "prefect")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def hash_json(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj``: the same value always gives the same key."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stage_key(stage: str, version: str, config: Any, input_keys: dict[str, str]) -> str:
    """The identity of a stage's output: what code, with which settings, on which inputs."""
    return hash_json({"stage": stage, "version": version, "config": config, "inputs": input_keys})


def library_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in _VERSIONED_LIBS:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            continue
    return out


@dataclass(frozen=True)
class Artifact:
    stage: str
    key: str
    path: Path  # a local directory (for remote roots: the local cache copy)
    manifest: dict[str, Any]

    @property
    def stats(self) -> dict[str, Any]:
        return self.manifest.get("stats", {})


class ArtifactStore:
    """Artifacts by (stage, key), verified on every reuse."""

    def __init__(self, root: str | Path, cache_dir: str | Path | None = None) -> None:
        import fsspec

        self.url = str(root)
        self.fs, base = fsspec.core.url_to_fs(self.url)
        self.is_local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple)
                                   else (self.fs.protocol,))
        if self.is_local:
            self.root = Path(base).resolve()
            self.root.mkdir(parents=True, exist_ok=True)
            self.local = self.root
        else:
            self.root = Path(base)
            self.local = Path(cache_dir or Path.cwd() / ".llmpipe" / "store-cache").resolve()
            self.local.mkdir(parents=True, exist_ok=True)

    # -- paths -----------------------------------------------------------------------------------
    def path(self, stage: str, key: str) -> Path:
        """Local directory of an artifact (the cache copy for a remote root)."""
        return self.local / stage / key

    def _remote(self, stage: str, key: str) -> str:
        return f"{self.root.as_posix()}/{stage}/{key}"

    def shard_cache_root(self, stage: str) -> Path:
        """Per-shard results reused across runs (always local)."""
        p = self.local / stage / SHARDS_DIR
        p.mkdir(parents=True, exist_ok=True)
        return p

    def new_tmp_dir(self, stage: str, key: str) -> Path:
        p = self.local / stage / f".tmp-{key[:16]}-{uuid.uuid4().hex[:8]}"
        p.mkdir(parents=True)
        return p

    # -- reading ----------------------------------------------------------------------------------
    def read_manifest(self, stage: str, key: str) -> dict[str, Any] | None:
        if not self.is_local:
            self._download(stage, key)
        mf = self.path(stage, key) / MANIFEST
        if not mf.is_file():
            return None
        try:
            return json.loads(mf.read_text())
        except (OSError, json.JSONDecodeError):
            log.warning("%s: unreadable manifest; the artifact will be recomputed", mf)
            return None

    def get(self, stage: str, key: str, verify: bool = True) -> Artifact | None:
        """The artifact if it exists and (when ``verify``) every file matches its manifest."""
        manifest = self.read_manifest(stage, key)
        if manifest is None:
            return None
        path = self.path(stage, key)
        if verify:
            problems = verify_files(path, manifest, self._stamp_path(stage, key))
            if problems:
                for p in problems:
                    log.warning("%s/%s: %s; recomputing the stage", stage, key[:12], p)
                return None
        return Artifact(stage, key, path, manifest)

    def _stamp_path(self, stage: str, key: str) -> Path:
        return self.local / stage / ".stamps" / f"{key}.json"

    def _download(self, stage: str, key: str) -> None:
        local = self.path(stage, key)
        if (local / MANIFEST).is_file():
            return
        remote = self._remote(stage, key)
        if not self.fs.exists(f"{remote}/{MANIFEST}"):
            return
        tmp = self.new_tmp_dir(stage, key)
        self.fs.get(remote + "/", str(tmp), recursive=True)
        _rename_into_place(tmp, local)

    # -- writing ----------------------------------------------------------------------------------
    def publish(self, stage: str, key: str, tmp: Path, *, version: str, config: Any,
                inputs: dict[str, str], stats: dict[str, Any], started: float,
                shards: list[str] | None = None) -> Artifact:
        """Hash every file of ``tmp``, write the manifest last, and move the directory into place.

        An artifact of the same key that is already there and verifies is kept and ``tmp`` discarded:
        its files are never pulled from under a reader (another run of the same key may be reading
        them). Only a stale copy that no longer verifies is replaced, and a reader would not trust it.
        ``shards``: the keys of the per-shard results (``<stage>/_shards/<key>``) the artifact was made
        from; the manifest lists them so that ``gc`` keeps exactly those.

        A file hard-linked from an earlier artifact of this stage (a refresh's reused shards and
        index) keeps that artifact's sha256 when it is the very same file (same device and inode)
        and its (size, mtime, inode) still match the stamp taken when that sha256 was computed or
        verified: the trust ``verify_files`` already places in stamps. Everything else is hashed.
        """
        remote_stale = not self.is_local and self.fs.exists(f"{self._remote(stage, key)}/{MANIFEST}")
        existing = self.get(stage, key)
        if existing is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            return existing
        paths = [f for f in sorted(tmp.rglob("*")) if f.is_file() and f.name != MANIFEST]
        known = self._stamped_digests(stage)

        def digest(f: Path) -> str:
            hit = known.get(_fingerprint(f))
            if hit is not None and hit[1].is_file() and os.path.samefile(hit[1], f):
                return hit[0]
            return sha256_file(f)

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib frees the GIL
            digests = list(pool.map(digest, paths))
        files = {f.relative_to(tmp).as_posix(): {"sha256": h, "bytes": f.stat().st_size}
                 for f, h in zip(paths, digests, strict=True)}
        manifest = {
            "stage": stage, "key": key, "version": version, "config": config, "inputs": inputs,
            "files": files, "stats": stats, SHARD_CACHE: sorted(set(shards or ())),
            "timings": {"started": _iso(started), "seconds": round(time.time() - started, 3)},
            "created": _iso(time.time()), "versions": library_versions(),
        }
        _write_json_atomic(tmp / MANIFEST, manifest)
        final = self.path(stage, key)
        if final.exists():  # a stale, unverifiable copy: set it aside, then drop it once ours is in place
            stale = self.local / stage / f".tmp-stale-{key[:16]}-{uuid.uuid4().hex[:8]}"
            os.rename(final, stale)
            _rename_into_place(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        elif not _rename_into_place(tmp, final):  # a concurrent run of the same key published first
            manifest = json.loads((final / MANIFEST).read_text())
        if not self.is_local:
            self._upload(stage, key, final, manifest, replace=remote_stale)
        self._write_stamp(stage, key, manifest)
        return Artifact(stage, key, final, manifest)

    def _upload(self, stage: str, key: str, final: Path, manifest: dict[str, Any], replace: bool) -> None:
        """Put a published artifact on the remote root: data first, manifest last.

        No manifest, no artifact: a reader never trusts a half-uploaded folder. The files go straight
        to their place (an object store has no atomic folder rename: s3fs's recursive ``mv`` of a
        prefix fails on S3). A remote copy that appeared since this publish began (another machine,
        the same key) is kept; only one that was there and failed verification at the start
        (``replace``) is removed first.
        """
        remote = self._remote(stage, key)
        if not replace and self.fs.exists(f"{remote}/{MANIFEST}"):
            return
        if replace and self.fs.exists(remote):
            self.fs.rm(remote, recursive=True)
        for rel in manifest["files"]:
            self.fs.put_file(str(final / rel), f"{remote}/{rel}")
        self.fs.put_file(str(final / MANIFEST), f"{remote}/{MANIFEST}")

    def _stamped_digests(self, stage: str) -> dict[tuple[int, int, int], tuple[str, Path]]:
        """(size, mtime, inode) -> (sha256, path) for the stamped files of this stage's local artifacts."""
        out: dict[tuple[int, int, int], tuple[str, Path]] = {}
        for sp in sorted((self.local / stage / ".stamps").glob("*.json")):
            try:  # local files only: a remote store is never contacted here
                manifest = json.loads((self.path(stage, sp.stem) / MANIFEST).read_text())
                stamp = json.loads(sp.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            files, base = manifest.get("files", {}), self.path(stage, sp.stem)
            for rel, fp in stamp.items():
                if rel in files and isinstance(fp, list) and len(fp) == 3:
                    out[(fp[0], fp[1], fp[2])] = (files[rel]["sha256"], base / rel)
        return out

    def _write_stamp(self, stage: str, key: str, manifest: dict[str, Any]) -> None:
        base = self.path(stage, key)
        stamp = {rel: _fingerprint(base / rel) for rel in manifest.get("files", {})}
        p = self._stamp_path(stage, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(p, stamp)

    # -- listing, lineage, runs, gc -------------------------------------------------------------
    def artifacts(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """Every published artifact as (stage, key, manifest), local view."""
        for stage_dir in sorted(p for p in self.local.iterdir() if p.is_dir() and not p.name.startswith("_")):
            for art in sorted(stage_dir.iterdir()):
                mf = art / MANIFEST
                if art.name.startswith((".", "_")) or not mf.is_file():
                    continue
                try:
                    yield stage_dir.name, art.name, json.loads(mf.read_text())
                except (OSError, json.JSONDecodeError):
                    continue

    def latest(self, stage: str, exclude_key: str | None = None) -> Artifact | None:
        """The most recently created artifact of a stage (e.g. the previous evaluation), verified."""
        best: tuple[str, str] | None = None
        for st, key, mf in self.artifacts():
            if st == stage and key != exclude_key and (best is None or mf.get("created", "") > best[0]):
                best = (mf.get("created", ""), key)
        return self.get(stage, best[1]) if best else None

    def find(self, key_or_path: str) -> tuple[str, str] | None:
        """Resolve a key, a unique key prefix, ``stage/key`` or an artifact path to (stage, key)."""
        p = Path(key_or_path)
        if (p / MANIFEST).is_file():
            mf = json.loads((p / MANIFEST).read_text())
            return mf["stage"], mf["key"]
        text = key_or_path.strip().rstrip("/")
        if "/" in text:
            stage, _, prefix = text.rpartition("/")
            stage = Path(stage).name
        else:
            stage, prefix = "", text
        hits = [(s, k) for s, k, _ in self.artifacts() if k.startswith(prefix) and (not stage or s == stage)]
        return hits[0] if len(hits) == 1 else None

    def lineage(self, stage: str, key: str) -> list[dict[str, Any]]:
        """The chain from an artifact back to the raw sources, depth first."""
        out: list[dict[str, Any]] = []
        seen: set[tuple[str, str]] = set()

        def walk(st: str, k: str, depth: int) -> None:
            if (st, k) in seen:
                return
            seen.add((st, k))
            mf = self.read_manifest(st, k)
            if mf is None:
                out.append({"depth": depth, "stage": st, "key": k, "missing": True})
                return
            out.append({"depth": depth, "stage": st, "key": k, "created": mf.get("created"),
                        "sources": mf.get("stats", {}).get("sources")})
            for in_name, in_key in sorted(mf.get("inputs", {}).items()):
                if in_name.startswith("source:"):
                    out.append({"depth": depth + 1, "stage": in_name, "key": in_key, "source": True})
                else:
                    walk(in_name, in_key, depth + 1)

        walk(stage, key, 0)
        return out

    def record_run(self, run: dict[str, Any], replace: Path | None = None) -> Path:
        """Remember which artifacts a run reached: ``gc`` keeps what any recorded run reaches.
        ``replace``: the run's :meth:`begin_run` record, which this final record takes the place of."""
        d = self.local / RUNS
        d.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        p = replace or d / f"{stamp}-{uuid.uuid4().hex[:6]}.json"
        _write_json_atomic(p, run)
        if not self.is_local:  # every driver's gc of a shared remote root must see this run
            self.fs.put_file(str(p), f"{self.root.as_posix()}/{RUNS}/{p.name}")
        return p

    def begin_run(self, flow: str, planned: dict[str, str]) -> Path:
        """Record a run that is starting, with every artifact it plans (stage -> key): until its final
        record replaces this one, a ``gc`` elsewhere keeps those artifacts, every per-shard result and
        ``.tmp-*`` folder of those stages (its work in progress). A record whose process is gone (same
        host, pid not alive: a killed run) no longer protects anything; gc removes it."""
        return self.record_run({"flow": flow, "status": RUNNING, "artifacts": planned, "host": socket.gethostname(),
                                "pid": os.getpid(), "pid_started": _process_started(os.getpid()),
                                "time": time.time()})

    @contextlib.contextmanager
    def running(self, flow: str, planned: dict[str, str]) -> Iterator[Path]:
        """:meth:`begin_run` for the block; its record is dropped when the block fails (a failed run
        reaches nothing, as before it had a record), and replaced by ``record_run(..., replace=)``
        when it succeeds."""
        begun = self.begin_run(flow, planned)
        try:
            yield begun
        except BaseException:
            begun.unlink(missing_ok=True)
            if not self.is_local:
                self.fs.rm(f"{self.root.as_posix()}/{RUNS}/{begun.name}")
            raise

    def reachable_shards(self, keep: set[tuple[str, str]]) -> dict[str, set[str] | None]:
        """Per stage, the per-shard results the artifacts in ``keep`` were made from; None for a stage
        with a kept artifact from before manifests listed them (then all of its shards are kept)."""
        out: dict[str, set[str] | None] = {}
        for st, k in sorted(keep):
            used = (self.manifest_only(st, k) or {}).get(SHARD_CACHE)
            known = out.get(st, set())
            out[st] = None if used is None or known is None else known | set(used)
        return out

    def manifest_only(self, stage: str, key: str) -> dict[str, Any] | None:
        """An artifact's manifest without fetching its files: the local copy, else the remote's."""
        mf = self.path(stage, key) / MANIFEST
        try:
            if mf.is_file():
                return json.loads(mf.read_text())
            if not self.is_local:
                return json.loads(self.fs.cat_file(f"{self._remote(stage, key)}/{MANIFEST}"))
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError):
            log.warning("%s/%s: unreadable manifest", stage, key[:12])
        return None

    def _run_records(self) -> Iterator[dict[str, Any]]:
        """Every recorded run: this machine's, and for a remote root every machine's (``<root>/_runs``);
        each with ``_name`` (its file's name)."""
        texts: dict[str, str] = {}
        local = self.local / RUNS
        for f in sorted(local.glob("*.json")) if local.is_dir() else []:
            texts[f.name] = f.read_text()
        if not self.is_local:
            remote = f"{self.root.as_posix()}/{RUNS}"
            names = self.fs.glob(f"{remote}/*.json") if self.fs.exists(remote) else []
            for name in sorted(names):
                if Path(name).name not in texts:
                    texts[Path(name).name] = self.fs.cat_file(name).decode()
        for name in sorted(texts):
            try:
                yield {**json.loads(texts[name]), "_name": name}
            except json.JSONDecodeError:
                log.warning("run record %s is unreadable; gc ignores it", name)

    def live_runs(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(records of runs still running, names of records whose run was killed while running)."""
        live, dead = [], []
        for run in self._run_records():
            if run.get("status") == RUNNING:
                (live if _still_running(run) else dead).append(run)
        return live, [r["_name"] for r in dead]

    def reachable(self) -> set[tuple[str, str]]:
        """(stage, key) of every artifact a recorded run reached, down to the sources."""
        keep: set[tuple[str, str]] = set()
        todo = [(st, k) for run in self._run_records() if run.get("status") != RUNNING  # see live_runs
                for st, k in run.get("artifacts", {}).items()]
        while todo:
            st, k = todo.pop()
            if (st, k) in keep:
                continue
            mf = self.manifest_only(st, k)
            if mf is None:
                continue
            keep.add((st, k))
            todo += [(s, v) for s, v in mf.get("inputs", {}).items() if not s.startswith("source:")]
        return keep

    def gc(self, dry_run: bool = True) -> list[tuple[str, int]]:
        """Artifacts no recorded run reaches, per-shard results (``_shards/``) none of the reached
        artifacts was made from, and temporary leftovers of killed runs in both: (path, bytes)."""
        keep = self.reachable()
        live, dead = self.live_runs()
        plan = _GcPlan(keep | {(st, k) for run in live for st, k in run.get("artifacts", {}).items()},
                       self.reachable_shards(keep), {st for run in live for st in run.get("artifacts", {})}, dead)
        doomed: list[Path] = []
        for stage_dir in (p for p in self.local.iterdir() if p.is_dir() and not p.name.startswith("_")):
            doomed += [art for art in stage_dir.iterdir() if plan.collects(stage_dir.name, art.name)]
            if (stage_dir / SHARDS_DIR).is_dir():
                doomed += [d for d in (stage_dir / SHARDS_DIR).iterdir() if plan.collects_shard(stage_dir.name, d.name)]
        doomed += [self.local / RUNS / name for name in dead if (self.local / RUNS / name).is_file()]
        out = [(str(p), _du(p) if p.is_dir() else p.stat().st_size) for p in sorted(doomed)]
        if not dry_run:
            for p in doomed:
                if p.is_file():
                    p.unlink(missing_ok=True)
                    continue
                shutil.rmtree(p, ignore_errors=True)
                stamp = p.parent / ".stamps" / f"{p.name}.json"
                stamp.unlink(missing_ok=True)
        return out + ([] if self.is_local else self._gc_remote(plan, dry_run))

    def _gc_remote(self, plan: _GcPlan, dry_run: bool) -> list[tuple[str, int]]:
        """The same collection on a remote root: artifacts, ``_shards/`` entries and ``.tmp-*`` folders
        (a killed driver's or worker's uploads), named by URL."""
        root = self.root.as_posix()
        doomed: list[str] = []
        for stage_path in self._remote_dirs(root):
            stage = Path(stage_path).name
            if stage.startswith("_"):
                continue
            doomed += [p for p in self._remote_dirs(stage_path) if plan.collects(stage, Path(p).name)]
            doomed += [p for p in self._remote_dirs(f"{stage_path}/{SHARDS_DIR}")
                       if plan.collects_shard(stage, Path(p).name)]
        doomed += [f"{root}/{RUNS}/{name}" for name in plan.dead if self.fs.exists(f"{root}/{RUNS}/{name}")]
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        out = [(f"{protocol}://{p.lstrip('/')}", int(self.fs.du(p))) for p in sorted(doomed)]
        if not dry_run:
            for p in doomed:
                self.fs.rm(p, recursive=True)
        return out

    def _remote_dirs(self, path: str) -> list[str]:
        """Sub-folders of a remote folder (none when it does not exist)."""
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"] for e in entries if e["type"] == "directory")


@dataclass(frozen=True)
class _GcPlan:
    """What gc keeps, the same for this machine's cache and a remote root."""

    keep: set[tuple[str, str]]  # (stage, key) reached by a recorded run or planned by a running one
    shards: dict[str, set[str] | None]  # per stage, the per-shard results kept artifacts used (None: all)
    busy: set[str]  # stages a running run works in: their per-shard results and .tmp-* stay
    dead: list[str]  # run records of runs killed while running

    def collects(self, stage: str, name: str) -> bool:
        """An entry of a stage folder: a temporary folder no running run may own, or an unreached artifact."""
        if name.startswith(".tmp-"):
            return stage not in self.busy
        return not name.startswith((".", "_")) and (stage, name) not in self.keep

    def collects_shard(self, stage: str, name: str) -> bool:
        if stage in self.busy:
            return False
        used = self.shards.get(stage, set())
        return name.startswith(".tmp-") or (used is not None and name not in used)


def _process_started(pid: int) -> float | None:
    """When a process started (tells a live pid from a reused one); None where psutil cannot say."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _still_running(run: dict[str, Any]) -> bool:
    """A running record's process is alive. On another host that cannot be checked: a record younger
    than ``RUNNING_TRUST_S`` counts as alive (a killed driver's record there protects for that long)."""
    if run.get("host") != socket.gethostname():
        return time.time() - float(run.get("time", 0)) < RUNNING_TRUST_S
    started = _process_started(int(run.get("pid", -1)))
    return started is not None and (run.get("pid_started") is None or abs(started - run["pid_started"]) < 1)


def verify_files(path: Path, manifest: dict[str, Any], stamp_path: Path | None = None) -> list[str]:
    """Problems with an artifact's files; empty when every file matches size and sha256.

    Hashing every file on every reuse would make a no-change rerun slow, so a stamp of
    (size, mtime, inode) taken at the last verification lets unchanged files skip the hash;
    anything that differs from the stamp (a touched or edited file) is hashed again.
    """
    stamp: dict[str, Any] = {}
    if stamp_path is not None and stamp_path.is_file():
        try:
            stamp = json.loads(stamp_path.read_text())
        except (OSError, json.JSONDecodeError):
            stamp = {}
    problems, new_stamp = [], {}
    for rel, info in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            problems.append(f"file {rel} is missing")
            continue
        fp = _fingerprint(f)
        if fp[0] != info["bytes"]:
            problems.append(f"file {rel} has {fp[0]} bytes, manifest says {info['bytes']}")
            continue
        if stamp.get(rel) != list(fp) and sha256_file(f) != info["sha256"]:
            problems.append(f"file {rel} was modified (sha256 differs from the manifest)")
            continue
        new_stamp[rel] = list(fp)
    if not problems and stamp_path is not None and new_stamp != stamp:
        stamp_path.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(stamp_path, new_stamp)
    return problems


def _fingerprint(f: Path) -> tuple[int, int, int]:
    st = f.stat()
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _rename_into_place(tmp: Path, final: Path) -> bool:
    """Move ``tmp`` to ``final``; False (``tmp`` discarded) when a concurrent run put one there first."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if (final / MANIFEST).is_file():  # a concurrent run published the same key first
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        raise
    return True


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str))
    os.replace(tmp, path)


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="milliseconds")


def _du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0
