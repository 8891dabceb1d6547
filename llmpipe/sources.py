"""Raw sources: finding their files and keying them by content.

A source's key is the hash of its files' (relative path, sha256) pairs, so moving the folder keeps
the cache and touching a file does not fool it. Hashing a large corpus on every run would be slow,
so a per-machine cache remembers each file's (size, mtime) → sha256: a file whose size and mtime
are unchanged is not re-read (the fast path); anything else is hashed again.
"""

from __future__ import annotations

import glob as _glob
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmpipe.store import hash_json, sha256_file

BUILTIN_PREFIX = "builtin:"
_COMPRESSED = ("", ".gz", ".zst")  # ingest reads each of these text and JSON formats plain, gzip or zstd
_TEXT_EXT = tuple(e + c for e in (".txt", ".md", ".rst", ".text") for c in _COMPRESSED)
_JSONL_EXT = tuple(e + c for e in (".jsonl", ".json", ".ndjson") for c in _COMPRESSED)
_PARQUET_EXT = (".parquet", ".pq")
UNKNOWN = "unknown"  # the format of a file whose type its name does not tell (quarantined, by config)
_lock = threading.Lock()


class SourceError(ValueError):
    pass


def detect_format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "hf_disk"
        return "folder"
    name = path.name.lower()
    if name.endswith(_JSONL_EXT):
        return "jsonl"
    if name.endswith(_PARQUET_EXT):
        return "parquet"
    if name.endswith(_TEXT_EXT):
        return "text"
    raise SourceError(f"{path}: cannot tell the format from the name; set format in the source config")


def source_files(src: Any, base_dir: Path, state_dir: Path) -> list[tuple[Path, str, str]]:
    """The files of a source as (path, format, relative name), in a stable order."""
    if src.path.startswith(BUILTIN_PREFIX):
        from llmpipe.data.builtin_corpus import materialize

        root = materialize(src.path[len(BUILTIN_PREFIX):], state_dir / "builtin")
        return [(p, "jsonl", p.relative_to(root).as_posix()) for p in sorted(root.glob("*.jsonl"))]
    raw = Path(os.path.expanduser(src.path))
    path = raw if raw.is_absolute() else base_dir / raw
    if any(c in src.path for c in "*?["):
        files = sorted(p for p in map(Path, _glob.glob(str(path), recursive=True)) if p.is_file())
        if not files:
            raise SourceError(f"sources.{src.name}.path: no files match {src.path!r}")
        root = glob_root(raw)  # of the pattern as written: the config's folder may hold '[' itself
        return _typed(src, root if root.is_absolute() else base_dir / root, files)
    if not path.exists():
        raise SourceError(f"sources.{src.name}.path: {path} does not exist")
    fmt = detect_format(path, src.format)
    if path.is_file() or fmt == "hf_disk":
        return [(path, fmt, path.name)]
    out = _typed(src, path, sorted(p for p in path.glob(src.glob) if p.is_file() and not p.name.startswith(".")))
    if not any(fmt != UNKNOWN for _, fmt, _ in out):
        raise SourceError(f"sources.{src.name}.path: {path} holds no readable files")
    return out


def glob_root(pattern: Path) -> Path:
    """The fixed prefix of a glob (``crawl/**/*.jsonl`` -> ``crawl``): the folder its files are named
    under. Not the common parent of today's matches, which moves when a sibling folder appears and
    would rename every file, id and shard downstream."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    return Path(*parts[:fixed]) if fixed else Path(".")


def _typed(src: Any, root: Path, files: list[Path]) -> list[tuple[Path, str, str]]:
    """(path, format, name under ``root``) of each file. A file whose type the name does not tell is an
    error naming every such file, or (``unknown_files: quarantine``) kept with format ``UNKNOWN`` so
    that ingest quarantines it with the reason: never skipped without a word."""
    out, unknown = [], []
    for p in files:
        rel = p.relative_to(root).as_posix()
        try:
            out.append((p, detect_format(p, src.format), rel))
        except SourceError:
            unknown.append(rel)
            out.append((p, UNKNOWN, rel))
    if unknown and src.unknown_files == "error":
        shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise SourceError(
            f"sources.{src.name}.path: {len(unknown)} file(s) of a type ingest cannot tell from the name under "
            f"{root}: {shown}; set sources[].format, narrow sources[].glob, or set "
            f"sources[].unknown_files: quarantine to quarantine them and go on")
    return out


def check_sources(cfg: Any) -> None:
    """Raise SourceError naming the key when the config has no sources or one that cannot be read.

    ``llmpipe run`` calls it before Prefect starts, so a typo costs no server start-up. The files are
    only listed here; hashing them is the planner's job (with its size/mtime cache).
    """
    if not cfg.sources:
        raise SourceError("sources: a pipeline needs at least one source, got [] "
                          "(e.g. sources: [{name: web, path: data/}])")
    state = Path(cfg.state_dir) if Path(cfg.state_dir).is_absolute() else Path.cwd() / cfg.state_dir
    for src in cfg.sources:
        source_files(src, cfg.base_dir(), state)


class HashCache:
    """sha256 of files, reused while size and mtime are unchanged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.data: dict[str, list[Any]] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            self.data = {}
        self.dirty = False

    def sha256(self, f: Path, compute: Callable[[Path], str] | None = None) -> str:
        """``compute`` (default: ``sha256_file``) runs on a miss; ingest passes one that also finds
        chunk bounds in the same read."""
        if f.is_dir():  # a datasets folder: hash of its files
            parts = [(p.relative_to(f).as_posix(), self.sha256(p)) for p in sorted(f.rglob("*")) if p.is_file()]
            return hash_json(parts)
        st = f.stat()
        k = str(f.resolve())
        hit = self.data.get(k)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        digest = (compute or sha256_file)(f)
        self.data[k] = [st.st_size, st.st_mtime_ns, digest]
        self.dirty = True
        return digest

    def memo(self, key: str, compute: Any) -> Any:
        """A value derived from a file's content (e.g. its chunk boundaries), keyed by its sha256."""
        if key not in self.data:
            self.data[key] = compute()
            self.dirty = True
        return self.data[key]

    def save(self) -> None:
        if not self.dirty:
            return
        with _lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)
        self.dirty = False
