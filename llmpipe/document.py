"""The ``Document`` record and its Parquet shards.

Every curation stage reads and writes shards of the same schema, so any stage's output can be
opened with ``datasets.load_dataset("parquet", ...)`` or pandas. ``metadata`` is stored as a JSON
string so that stages can add keys (lang, scores, parent_id, ...) without a schema migration.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.stage import lazy_import

# pyarrow loads on first use: every ``llmpipe`` command imports this module to learn the DAG
pa = lazy_import("pyarrow")
pq = lazy_import("pyarrow.parquet")
SHARD_GLOB = "*.parquet"


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
    return json.dumps(meta, ensure_ascii=False, sort_keys=True, default=str)


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
    return pa.Table.from_arrays(
        [pa.array(ids, pa.string()), pa.array(texts, pa.string()), pa.array(sources, pa.string()),
         pa.array(metas, pa.string())],
        schema=shard_schema(),
    )


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
    pq.write_table(table.combine_chunks(), path, compression=compression, write_statistics=False,
                   use_dictionary=use)


def read_shard(path: str | Path) -> list[Document]:
    """Read every document of one shard."""
    return list(iter_documents(path))


def iter_documents(path: str | Path, batch_size: int = 4096) -> Iterator[Document]:
    pf = pq.ParquetFile(path)
    for batch in pf.iter_batches(batch_size=batch_size):
        cols = batch.to_pydict()
        for i, t, s, m in zip(cols["id"], cols["text"], cols["source"], cols["metadata"], strict=True):
            yield Document(id=i, text=t, source=s, metadata=_loads(m) if m else {})


def _loads(s: str) -> Any:
    return _orjson.loads(s) if _orjson is not None else json.loads(s)


def shard_paths(directory: str | Path) -> list[Path]:
    """The document shards of an artifact, in their stable order (``<dir>/shards/*.parquet``)."""
    return sorted((Path(directory) / "shards").glob(SHARD_GLOB))
