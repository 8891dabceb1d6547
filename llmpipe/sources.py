"""Raw sources: finding their files and keying them by content.

A source's key is the hash of its files' (relative path, sha256) pairs, so moving the folder keeps
the cache and touching a file does not fool it. Hashing a large corpus on every run would be slow,
so a per-machine cache remembers each file's (size, mtime) → sha256: a file whose size and mtime
are unchanged is not re-read (the fast path); anything else is hashed again.

A source given as an fsspec URL (``s3://bucket/crawl/**/*.jsonl``) is listed where it lives and never
downloaded by the planner: a file's content identity is the store's own checksum from the listing (see
:func:`url_identity`), and the shard jobs open the URL themselves (``ingest.open_source``).
"""

from __future__ import annotations

import glob as _glob
import json
import os
import re
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
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*(://|::)")  # s3://..., memory://..., simplecache::s3://...
# A listing's content checksum, by filesystem: s3fs and adlfs (ETag), gcsfs (md5Hash, crc32c)
_CHECKSUM_KEYS = ("ETag", "etag", "md5Hash", "crc32c")


class SourceError(ValueError):
    pass


def is_url(path: str) -> bool:
    """Whether a source path is an fsspec URL (``s3://bucket/crawl/``, ``memory://x``), not a local path."""
    return _URL.match(path) is not None


def detect_format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "hf_disk"
        return "folder"
    return format_of_name(path.name, str(path), declared)


def format_of_name(name: str, where: str, declared: str = "auto") -> str:
    """A file's format from its name (``.jsonl[.gz|.zst]``, ``.parquet``, ``.txt``...), or the declared one."""
    if declared != "auto":
        return declared
    name = name.lower()
    if name.endswith(_JSONL_EXT):
        return "jsonl"
    if name.endswith(_PARQUET_EXT):
        return "parquet"
    if name.endswith(_TEXT_EXT):
        return "text"
    raise SourceError(f"{where}: cannot tell the format from the name; set format in the source config")


def source_files(src: Any, base_dir: Path, state_dir: Path) -> list[tuple[Path | str, str, str]]:
    """The files of a source as (path, format, relative name), in a stable order; a URL source's
    files come as URL strings (see :func:`url_files`), a local one's as ``Path``."""
    if is_url(src.path):
        return [(url, fmt, rel) for url, fmt, rel, _ in url_files(src)]
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
        root = root if root.is_absolute() else base_dir / root
        return _typed(src, root, [(p, p.relative_to(root).as_posix()) for p in files])
    if not path.exists():
        raise SourceError(f"sources.{src.name}.path: {path} does not exist")
    fmt = detect_format(path, src.format)
    if path.is_file() or fmt == "hf_disk":
        return [(path, fmt, path.name)]
    found = sorted(p for p in path.glob(src.glob) if p.is_file() and not p.name.startswith("."))
    return _readable(src, path, _typed(src, path, [(p, p.relative_to(path).as_posix()) for p in found]))


def _readable(src: Any, where: Any, files: list[Any]) -> list[Any]:
    """A folder's files, refused when none of them is of a type ingest reads."""
    if not any(f[1] != UNKNOWN for f in files):
        raise SourceError(f"sources.{src.name}.path: {where} holds no readable files")
    return files


def url_files(src: Any) -> list[tuple[str, str, str, str]]:
    """The files of a URL source as (URL, format, relative name, content identity), listed in one go.

    As for local paths: a glob's files are named under its fixed prefix (:func:`glob_root`), a folder's
    under the folder (``src.glob`` inside it), a single file by its name; so the same files give the
    same names, ids and shards under a URL as on the local disk.
    """
    import fsspec

    where = f"sources.{src.name}.path"
    try:
        fs, path = fsspec.core.url_to_fs(src.path)
    except (ImportError, ValueError) as e:  # an unknown protocol, or its package not installed
        raise SourceError(f"{where}: cannot open {src.path!r}: {e}") from e
    fs.invalidate_cache()  # a listing cached by this long-lived process would hide new uploads and ETags
    if any(c in src.path for c in "*?["):
        root = _url_glob_root(src.path)
        listing = fs.glob(path, detail=True)
        if not any(info.get("type") == "file" for info in listing.values()):
            raise SourceError(f"{where}: no files match {src.path!r}")
        return _url_typed(src, fs, root, listing)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise SourceError(f"{where}: {src.path} does not exist") from None
    if info.get("type") != "directory":
        name = src.path.rstrip("/").rsplit("/", 1)[-1]
        return [(src.path, format_of_name(name, src.path, src.format), name, url_identity(fs, path, info))]
    base = path.rstrip("/")
    if src.format in ("auto", "hf_disk") and any(fs.isfile(f"{base}/{m}") for m in ("dataset_info.json", "state.json")):
        raise SourceError(f"{where}: {src.path} is a `save_to_disk` folder: ingest reads those from a local path "
                          "only (copy it down, or export it as Parquet)")
    listing = fs.glob(f"{base}/{src.glob}", detail=True)
    listing = {p: info for p, info in listing.items() if not p.rsplit("/", 1)[-1].startswith(".")}
    return _readable(src, src.path, _url_typed(src, fs, src.path.rstrip("/"), listing))


def _url_glob_root(pattern: str) -> str:
    """A URL glob's fixed prefix (``s3://b/crawl/**/*.jsonl`` -> ``s3://b/crawl``), as :func:`glob_root`."""
    parts = pattern.split("/")
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    return "/".join(parts[:fixed])


def _url_typed(src: Any, fs: Any, root: str, listing: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """(URL, format, name under ``root``, identity) of each file of a listing, sorted by name."""
    import fsspec

    base = fsspec.core.url_to_fs(root)[1].rstrip("/") + "/"
    files = []
    for p, info in listing.items():
        if info.get("type") != "file":
            continue
        if not p.startswith(base):
            raise SourceError(f"sources.{src.name}.path: {p} is not under {root}")
        rel = p[len(base):]
        files.append((f"{root}/{rel}", rel, url_identity(fs, p, info)))
    files.sort(key=lambda f: f[1])
    typed = _typed(src, root, [(url, rel) for url, rel, _ in files])
    return [(url, fmt, rel, ident) for (url, fmt, rel), (_, _, ident) in zip(typed, files, strict=True)]


def url_identity(fs: Any, path: str, info: dict[str, Any]) -> str:
    """What stands for a remote file's sha256 in ingest's keys, taken without reading the file.

    The listing's content checksum where the filesystem has one (S3's ``ETag``: the MD5 of a
    single-part object, a hash of the parts' MD5s for a multipart one; GCS's ``md5Hash``), else
    ``fs.checksum`` (fsspec's token of ``fs.info``: size and modified time), with the size. A new
    upload changes it, so a changed file is read again and the others are not; hashing every byte
    on the driver would download the corpus the workers are about to stream.
    """
    tag = next((f"{k}:{info[k]}" for k in _CHECKSUM_KEYS if info.get(k)), None)
    if tag is None:
        tag = f"checksum:{fs.checksum(path)}"
    return "fsspec:" + hash_json([tag, info.get("size")])


def glob_root(pattern: Path) -> Path:
    """The fixed prefix of a glob (``crawl/**/*.jsonl`` -> ``crawl``): the folder its files are named
    under. Not the common parent of today's matches, which moves when a sibling folder appears and
    would rename every file, id and shard downstream."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
    return Path(*parts[:fixed]) if fixed else Path(".")


def _typed(src: Any, root: Any, files: list[tuple[Any, str]]) -> list[tuple[Any, str, str]]:
    """(path, format, name under ``root``) of each (path or URL, name under ``root``). A file whose type
    the name does not tell is an error naming every such file, or (``unknown_files: quarantine``) kept
    with format ``UNKNOWN`` so that ingest quarantines it with the reason: never skipped without a word."""
    out, unknown = [], []
    for p, rel in files:
        try:
            out.append((p, format_of_name(rel.rsplit("/", 1)[-1], str(p), src.format), rel))
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
