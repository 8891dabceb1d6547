"""The ``Document`` record and its Parquet shards.

Every curation stage reads and writes shards of the same schema, so any stage's output can be
opened with ``datasets.load_dataset("parquet", ...)`` or pandas. ``metadata`` is stored as a JSON
string so that stages can add keys (lang, scores, parent_id, ...) without a schema migration, and
so that a source record's own fields, nested objects and arrays included, ride through every stage
as they were given (``Document.meta("metadata.published")`` reads one).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.lazy import lazy_import
from llmpipe.store import MANIFEST, sha256_file

# pyarrow loads on first use: every ``llmpipe`` command imports this module to learn the DAG
pa = lazy_import("pyarrow")
np = lazy_import("numpy")  # string_array: a string column's offsets
pq = lazy_import("pyarrow.parquet")
SHARD_GLOB = "*.parquet"
# The declared layout of every document stage's artifact (ingest, langid, quality, safety, dedup,
# augment): producers write and consumers read these folders by these names, never a spelled-out
# sub-path. ``SHARDS`` holds the kept documents, loadable as they are with
# ``datasets.load_dataset("parquet", data_dir=<artifact>/shards)``; ``REJECTED`` the documents a
# stage removed, with ``metadata["reject_reason"]`` (and the filters' scores).
SHARDS = "shards"
REJECTED = "rejected"


@functools.cache
def shard_schema() -> pa.Schema:
    """The shards' schema: four non-null strings."""
    return pa.schema([pa.field(name, pa.string(), nullable=False) for name in ("id", "text", "source", "metadata")])


@dataclass
class Document:
    """One text and where it came from. ``metadata`` holds lang, lang_score, scores, parent_id, ..."""

    id: str
    text: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def meta(self, path: str | Sequence[str | int], default: Any = None) -> Any:
        """The metadata value at ``path`` (see ``metadata_value``): ``doc.meta("metadata.published")``."""
        return metadata_value(self.metadata, path, default)


def metadata_value(meta: dict[str, Any], path: str | Sequence[str | int], default: Any = None) -> Any:
    """The value at a dotted ``path`` of a metadata dict, as the source record held it.

    Ingest keeps every field of a record besides its text at the same place in the metadata, nested
    objects and arrays included, so ``"metadata.published"`` reads ``{"metadata": {"published": ...}}``
    and ``"links.0.href"`` the first element of a list. A key that itself holds a dot is found whole
    first; a sequence of keys and indexes (``("a.b", 0)``) names any path exactly. ``default`` when
    the path is absent.
    """
    if isinstance(path, str):
        if path in meta:
            return meta[path]
        path = path.split(".")
    value: Any = meta
    for key in path:
        if isinstance(value, dict) and str(key) in value:
            value = value[str(key)]
        elif isinstance(value, list) and str(key).lstrip("-").isdigit() and -len(value) <= int(key) < len(value):
            value = value[int(key)]  # an index counts from the end when negative, as in Python
        else:
            return default
    return value


ID_BYTES = 12  # 24 hex characters


def stable_id(source: str, locator: str, text: str) -> str:
    """A document id that is the same on every run: hash of where it came from and what it says.

    sha256 (cut to 96 bits) rather than blake2b: with the SHA extensions of current CPUs it hashes
    about twice as fast, and ingest hashes every text once.
    """
    data = f"{source}\x00{locator}\x00{text}\x00".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[: 2 * ID_BYTES]


def dump_metadata(meta: dict[str, Any]) -> str:
    """Canonical JSON of a metadata dict (sorted keys, UTF-8), so shard bytes are reproducible."""
    if _orjson is not None:
        try:
            return _orjson.dumps(meta, option=_orjson.OPT_SORT_KEYS | _orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:
            pass
    # json's own separators, spelled out: ``_loads`` knows this fallback's text (ints past 64 bits) by them
    return json.dumps(meta, ensure_ascii=False, sort_keys=True, default=str, separators=(", ", ": "))


try:  # 5-10x faster than json for the per-document metadata; identical output is not needed, stability is
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None


def to_table(docs: Iterable[Document]) -> pa.Table:
    ids, texts, sources, metas = [], [], [], []
    for d in docs:
        ids.append(d.id)
        texts.append(d.text)
        sources.append(d.source)
        metas.append(dump_metadata(d.metadata))
    return pa.Table.from_arrays([string_array(ids), string_array(texts), string_array(sources), string_array(metas)],
                                schema=shard_schema())


def read_columns(path: str | Path, columns: Sequence[str] | None = None) -> pa.Table:
    """One Parquet file's columns (all when None) as a table: ``pq.read_table`` for a single file,
    without its dataset layer, whose import pulls in pandas (~0.4 CPU-seconds per process)."""
    with pq.ParquetFile(path) as f:
        return f.read(columns=list(columns) if columns is not None else None)


def numpy_array(values: Any, dtype: str) -> pa.Array:
    """``pa.array(values, <dtype>)`` for a 1-D numpy array of a fixed-width number type (``"uint8"``,
    ``"int64"``, ...), from its buffer: ``pa.array`` would import pandas (see :func:`string_array`)."""
    arr = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(pa.from_numpy_dtype(arr.dtype), len(arr), [None, pa.py_buffer(arr)])


def string_array(values: list[str]) -> pa.Array:
    """``pa.array(values, pa.string())``, built from its UTF-8 buffer and offsets: the same array, but
    ``pa.array`` first asks whether its input is a pandas object, which imports pandas (~0.4
    CPU-seconds in every process that writes a shard, for nothing). Past int32 offsets: ``pa.array``."""
    try:
        data = [v.encode("utf-8") for v in values]
    except AttributeError:  # a None (null): pyarrow's own conversion
        return pa.array(values, pa.string())
    offsets = np.zeros(len(data) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, data), dtype=np.int64, count=len(data)), out=offsets[1:])
    if offsets[-1] >= 2**31:
        return pa.array(values, pa.string())
    offsets = offsets.astype(np.int32)
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets), pa.py_buffer(b"".join(data)))


def write_shard(path: str | Path, docs: Iterable[Document], dictionary: bool | Sequence[str] = True,
                compression: str = "zstd") -> int:
    """Write documents to one Parquet shard (deterministic bytes for the same documents)."""
    table = to_table(docs)
    write_table(path, table, dictionary=dictionary, compression=compression)
    return table.num_rows


def write_table(path: str | Path, table: pa.Table, dictionary: bool | Sequence[str] = True,
                compression: str = "zstd") -> None:
    """Write a table of ``shard_schema()`` as one shard (the same bytes for the same rows).

    ``dictionary`` names the columns worth dictionary-encoding; on columns whose values are all
    different (ids, texts) the encoder builds a dictionary only to drop it, at a cost in time.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    use = dictionary if isinstance(dictionary, bool) else list(dictionary)
    if table.num_rows == 0:  # no row group at all: `datasets` fails on a row group of 0 rows
        pq.ParquetWriter(path, table.schema, compression=compression, write_statistics=False,
                         use_dictionary=use).close()
        return
    pq.write_table(table.combine_chunks(), path, compression=compression, write_statistics=False,
                   use_dictionary=use)


def read_shard(path: str | Path) -> list[Document]:
    """Read every document of one shard."""
    return list(iter_documents(path))


def iter_documents(path: str | Path, batch_size: int = 4096) -> Iterator[Document]:
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(batch_size=batch_size, use_threads=False):  # as iter_rows: less CPU
        cols = batch.to_pydict()
        for i, t, s, m in zip(cols["id"], cols["text"], cols["source"], cols["metadata"], strict=True):
            yield Document(id=i, text=t, source=s, metadata=_loads(m) if m else {})


def iter_rows(path: str | Path, columns: Sequence[str], batch_size: int = 4096) -> Iterator[tuple[Any, ...]]:
    """Some columns of a shard, one tuple per row (``metadata`` parsed to a dict), in row order.

    For a scorer that reads a text and a metadata field or two: no :class:`Document` per row, and the
    columns it does not name (ids, sources) are never converted to Python strings.
    """
    cols = list(columns)
    meta_at = cols.index("metadata") if "metadata" in cols else -1
    # no pyarrow thread pool: shard workers are the parallelism (the pool cost a third more CPU here)
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=cols, use_threads=False):
        values = [batch.column(c).to_pylist() for c in cols]
        if meta_at >= 0:
            values[meta_at] = [load_metadata(m) for m in values[meta_at]]
        yield from zip(*values, strict=True)


def load_metadata(s: str | None) -> dict[str, Any]:
    """A shard's metadata string back to its dict (empty: ``{}``), as :func:`iter_documents` reads it."""
    return _loads(s) if s else {}


def _loads(s: str) -> Any:
    """A metadata string back to its dict. orjson would read an integer past 64 bits as a float, but
    it cannot write one either: ``dump_metadata`` falls back to json for such values, and json's
    ``": "`` separator (orjson's output has none outside strings) sends those strings to json."""
    if _orjson is None or '": ' in s:
        return json.loads(s)
    return _orjson.loads(s)


def shard_paths(directory: str | Path) -> list[Path]:
    """The document shards of an artifact, in their stable order (``<dir>/shards/*.parquet``)."""
    return sorted((Path(directory) / SHARDS).glob(SHARD_GLOB))


@dataclass(frozen=True)
class InputShard:
    """One upstream shard with its content hash: per-shard cache keys and refresh prefixes use the hash."""

    path: Path
    sha256: str

    @property
    def name(self) -> str:
        return self.path.name


def input_shards(directory: str | Path) -> list[InputShard]:
    """An upstream artifact's shards in their stable order, each with its sha256.

    The hash comes from the artifact's manifest when it lists the file (no re-read of published
    bytes), else the file is hashed now (an artifact being built, or a test's bare folder).
    """
    directory = Path(directory)
    files: dict[str, Any] = {}
    mf = directory / MANIFEST
    if mf.is_file():
        files = json.loads(mf.read_text()).get("files", {})
    out = []
    for p in shard_paths(directory):
        sha = files.get(f"{SHARDS}/{p.name}", {}).get("sha256")
        out.append(InputShard(p, str(sha) if sha else sha256_file(p)))
    return out


def rejected_paths(directory: str | Path) -> list[Path]:
    """The rejected-document shards of an artifact, in their stable order (``<dir>/rejected/*.parquet``)."""
    return sorted((Path(directory) / REJECTED).glob(SHARD_GLOB))
