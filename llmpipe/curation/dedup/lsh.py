"""LSH candidate search over MinHash signatures: datasketch (memory or Redis) or out-of-core on disk.

Every backend answers the same question for a batch of new documents with global indexes
``first .. first + n - 1``: for each new ``j`` and each LSH band, the **anchor** of ``j``'s bucket
(its smallest member) when that is an earlier document: edges ``(j, anchor)``, at most ``bands``
per document however large a bucket grows (see :mod:`llmpipe.curation.dedup.core`). datasketch
keys buckets by the band's bytes; the external backend by a 64-bit hash of them (a spurious 64-bit
collision is ~n^2/2^64 and is then caught by verification).
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from datasketch import LeanMinHash, MinHashLSH

from llmpipe.curation.dedup import datasketch_adapter as ds
from llmpipe.curation.dedup.core import anchor_edges, unique_edges
from llmpipe.memory import gc_paused

_U64 = np.uint64


@lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int, bands: int | None = None, rows: int | None = None,
               fp_weight: float = 0.5, fn_weight: float = 0.5) -> tuple[int, int]:
    """(bands, rows): given, or datasketch's optimum for the threshold and weights."""
    if bands is not None and rows is not None:
        return int(bands), int(rows)
    return ds.optimal_params(threshold, num_perm, fp_weight, fn_weight)


def _fmix64(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> _U64(33))
    h = h * _U64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> _U64(33))


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: a 64-bit hash of each band's values, salted with the band number."""
    n = sigs.shape[0]
    out = np.empty((n, bands), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for band in range(bands):
            h = np.full(n, _U64(0x9E3779B97F4A7C15) * _U64(band + 1), dtype=np.uint64)
            for c in range(band * rows, (band + 1) * rows):
                h = _fmix64(h ^ sigs[:, c].astype(np.uint64))
            out[:, band] = h
    return out


# -- datasketch backends ---------------------------------------------------------------------------

# Filling a ``MinHashLSH`` allocates ~2 acyclic containers per (document, band): with the cyclic GC
# on, its repeated full collections over the growing heap cost ~8x the inserts themselves, so every
# bulk insert below runs under ``gc_paused``.


class DatasketchIndex:
    """``MinHashLSH`` over ``LeanMinHash`` keyed by global document index (dict or Redis storage).

    The dict storage is not persisted as such: ``index/lsh.json`` records the storage, and a refresh
    rebuilds what it needs of the index from the previous artifact's per-shard signatures
    (``index/shards/*/sig.npy``, exact-unique rows) with :meth:`bulk_insert`: only the old documents
    that share a band key with a new one, since only those can be a new document's anchor (see
    ``stage._bucket_mates``). So the index files are a function of the input shards alone, and a
    refresh writes the same bytes as a cold run of the same key (a pickle of the whole index, or one
    delta file per refresh, would depend on the run history). The refresh still reads every old
    signature once (vectorized band keys, ~1% of a cold run), but inserts O(new) documents.
    Redis storage lives in the server under ``basename`` (recorded in ``lsh.json``), which a refresh
    reuses.
    """

    def __init__(self, lsh: MinHashLSH, seed: int, meta: dict[str, Any]) -> None:
        self.lsh, self.seed, self.meta = lsh, seed, meta
        self.inserts = 0
        self.queries = 0
        self._anchors: dict[tuple[int, bytes], int] = {}  # (band, bucket key) -> its smallest member

    @classmethod
    def create(cls, threshold: float, num_perm: int, params: tuple[int, int], seed: int,
               storage: dict[str, Any] | None = None) -> DatasketchIndex:
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, params=params, storage_config=storage)
        meta = {"storage": {k: v for k, v in (storage or {"type": "dict"}).items() if k != "basename"}}
        if storage and "basename" in storage:
            meta["basename"] = storage["basename"].decode()
        return cls(lsh, seed, meta)

    @property
    def _banded(self) -> int:
        return self.lsh.b * self.lsh.r

    def _lean(self, row: np.ndarray) -> LeanMinHash:
        return ds.lean(row, self.seed)

    def add_and_query(self, idx: np.ndarray, sigs: np.ndarray, query: bool = True) -> np.ndarray:
        """Insert docs ``idx`` (ascending), then their anchor edges ``(j, anchor < j)``, shape (m, 2).

        A bucket's anchor is the minimum of its members (``hashtables[band].get(key)``), computed
        once per bucket and run and cached: later inserts into it are larger, so it never changes.
        """
        with gc_paused(), self.lsh.insertion_session(buffer_size=10_000) as session:
            for k in range(len(sigs)):
                session.insert(int(idx[k]), self._lean(sigs[k]), check_duplication=False)
        self.inserts += len(sigs)
        if not query or not len(sigs):
            return np.zeros((0, 2), np.int64)
        js: list[int] = []
        anchors: list[int] = []
        for band, (keys, table) in enumerate(zip(ds.bucket_keys(self.lsh, sigs), self.lsh.hashtables, strict=True)):
            for k, key in enumerate(keys):
                a = self._anchors.get((band, key))
                if a is None:
                    members = table.get(key)
                    a = min(pickle.loads(m) for m in members) if self.lsh.prepickle else min(members)
                    self._anchors[(band, key)] = a
                if a < idx[k]:
                    js.append(int(idx[k]))
                    anchors.append(int(a))
        self.queries += len(sigs)
        return unique_edges(np.array([js, anchors], dtype=np.int64).T.reshape(-1, 2))

    def bulk_insert(self, idx: np.ndarray, bands: np.ndarray) -> None:
        """Insert without a query, straight into the dict storage: what ``MinHashLSH.insert`` stores.

        Used to rebuild the index of a refresh's old shards: ``insert`` builds a ``LeanMinHash`` per
        document and byteswaps each band separately; :func:`datasketch_adapter.bulk_insert` computes every bucket key with one
        numpy byteswap. The first document goes through ``insert``, so datasketch records the
        scheme of an empty index (or checks it against a loaded one's). Tests check that the tables
        equal those ``insert`` builds.
        """
        lsh = self.lsh
        if not len(idx):
            return
        row = np.zeros(lsh.h, np.uint32)
        row[: self._banded] = bands[0, : self._banded]
        with gc_paused():
            lsh.insert(int(idx[0]), self._lean(row), check_duplication=False)
            ds.bulk_insert(lsh, [int(k) for k in idx[1:]], bands[1:])

    def save(self, index_dir: Path) -> None:
        """``lsh.json``: the storage (and the Redis basename); the buckets are rebuilt from signatures."""
        (index_dir / "lsh.json").write_text(json.dumps(self.meta, sort_keys=True))

    def close(self) -> None:
        """Free a dict index's buckets now, by reference counting (see ``datasketch_adapter.free``)."""
        if self.meta["storage"]["type"] == "dict":
            ds.free(self.lsh)

    @classmethod
    def load_redis(cls, index_dir: Path, seed: int, storage: dict[str, Any], threshold: float,
                   num_perm: int, params: tuple[int, int]) -> DatasketchIndex | None:
        """The previous run's Redis index (its basename), or None when it was built by another backend."""
        meta_path = index_dir / "lsh.json"
        if not meta_path.is_file():
            return None
        meta = json.loads(meta_path.read_text())
        if meta["storage"]["type"] != "redis":
            return None
        return cls.create(threshold, num_perm, params, seed, {**storage, "basename": meta["basename"].encode()})


# -- out-of-core backend ---------------------------------------------------------------------------

class ExternalIndex:
    """Band buckets as sorted (key, doc) runs on disk, one run per input shard; bounded memory.

    The candidate search walks the 64-bit key space in ``partitions`` ranges sized so that one
    range's records (from every run) fit in ``memory_budget_mb``; within a range the records are
    sorted by key and each bucket holding a new document yields its (new, earlier) pairs.

    A refresh whose new records fit the budget skips that scan (:meth:`_query_lookup`): the runs
    it was opened with hold only earlier documents, so the anchor of a new record's bucket is the
    first record of that key in the earliest old run holding it, found by binary search in each
    old run's sorted keys. Its cost follows the new documents (times log of a run), not the corpus.
    """

    RECORD_BYTES = 16

    def __init__(self, runs: list[Path], bands: int, rows: int, memory_budget_mb: float) -> None:
        self.runs = list(runs)  # directories holding keys.npy (sorted uint64) + docs.npy (int64)
        self.old_runs = len(runs)  # runs of an earlier artifact: only documents before this run's new ones
        self.bands, self.rows = bands, rows
        self.budget = max(1, int(memory_budget_mb * (1 << 20)))
        self.inserts = 0
        self.queries = 0

    def write_run(self, run_dir: Path, idx: np.ndarray, sigs: np.ndarray) -> None:
        """Append one shard's band records (sorted by key) as a new run."""
        run_dir.mkdir(parents=True, exist_ok=True)
        keys = band_keys(sigs, self.bands, self.rows).ravel()
        docs = np.repeat(np.asarray(idx, dtype=np.int64), self.bands)
        order = np.argsort(keys, kind="stable")
        np.save(run_dir / "keys.npy", keys[order])
        np.save(run_dir / "docs.npy", docs[order])
        self.runs.append(run_dir)
        self.inserts += len(sigs)

    def _records(self) -> int:
        return sum(int(np.load(r / "keys.npy", mmap_mode="r").shape[0]) for r in self.runs)

    def partitions(self) -> int:
        # sort + unique + pair building need ~6x the raw records of one range
        return max(1, -(-self._records() * self.RECORD_BYTES * 6 // self.budget))

    def _ranges(self, parts: int) -> Iterator[tuple[int, int]]:
        edges = [(p << 64) // parts for p in range(parts + 1)]
        for p in range(parts):
            yield edges[p], edges[p + 1]

    def _load_range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        keys, docs = [], []
        for r in self.runs:
            k = np.load(r / "keys.npy", mmap_mode="r")
            a = int(np.searchsorted(k, _U64(lo), side="left"))
            b = len(k) if hi >= (1 << 64) else int(np.searchsorted(k, _U64(hi), side="left"))
            if b > a:
                keys.append(np.array(k[a:b]))
                docs.append(np.array(np.load(r / "docs.npy", mmap_mode="r")[a:b]))
            del k  # drop the mapping so its pages leave the resident set
        if not keys:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        return np.concatenate(keys), np.concatenate(docs)

    def query_new(self, first_new: int, last: int, spill: Path) -> Iterator[np.ndarray]:
        """Anchor edges ``(j, anchor)`` of the new docs ``first_new <= j < last``, in ascending ``j``.

        Each key range's edges are spilled to ``spill`` split by blocks of ``j`` sized to the
        budget; then each block's files are merged and yielded in turn, so neither the records
        nor the edges are ever all in memory (a document has at most ``bands`` edges).
        """
        # a block's edges (<= bands a document) and their dedup copies fit the budget. Not capped at a
        # few thousand documents (when verification held a block's keepers' texts): each key range
        # writes a spill file per block, so small blocks made files grow with n x n / block
        block = max(1, self.budget // (self.bands * self.RECORD_BYTES * 4))
        fresh = self.runs[self.old_runs:]
        n_fresh = sum(int(np.load(r / "keys.npy", mmap_mode="r").shape[0]) for r in fresh)
        if n_fresh * self.RECORD_BYTES * 6 <= self.budget:
            yield from self._query_lookup(first_new, block)
            return
        spill.mkdir(parents=True, exist_ok=True)
        for p, (lo, hi) in enumerate(self._ranges(self.partitions())):
            keys, docs = self._load_range(lo, hi)
            if len(keys) < 2:
                continue
            order = np.lexsort((docs, keys))
            edges = anchor_edges(keys[order], docs[order], first_new)
            del keys, docs, order
            if not len(edges):
                continue
            blocks = (edges[:, 0] - first_new) // block
            order = np.argsort(blocks, kind="stable")
            edges, blocks = edges[order], blocks[order]
            cuts = np.flatnonzero(np.concatenate(([True], blocks[1:] != blocks[:-1]))).tolist()
            for s, e in zip(cuts, [*cuts[1:], len(blocks)], strict=True):
                np.save(spill / f"{int(blocks[s]):08d}-{p:06d}.npy", edges[s:e])
        self.queries += 1
        # one listing of the spill folder, grouped by block (a glob per block listed every block's
        # files again: blocks x files, ~10^4 x 10^4 at 2M documents)
        by_block: dict[int, list[Path]] = {}
        for f in sorted(spill.glob("*.npy")):
            by_block.setdefault(int(f.name.split("-", 1)[0]), []).append(f)
        for b in sorted(by_block):
            files = by_block.pop(b)
            yield unique_edges(np.concatenate([np.load(f) for f in files]))
            for f in files:
                f.unlink()
        shutil.rmtree(spill, ignore_errors=True)

    def _query_lookup(self, first_new: int, block: int) -> Iterator[np.ndarray]:
        """:meth:`query_new` when this run's own records fit the budget: the same edges, in the same
        blocks, from the new records and a binary search of each old run (see the class docstring)."""
        keys, docs = [], []
        for r in self.runs[self.old_runs:]:
            keys.append(np.load(r / "keys.npy"))
            docs.append(np.load(r / "docs.npy"))
        if not keys or not sum(len(k) for k in keys):
            return
        keys_new, docs_new = np.concatenate(keys), np.concatenate(docs)
        order = np.lexsort((docs_new, keys_new))
        keys_new, docs_new = keys_new[order], docs_new[order]
        starts = np.concatenate(([True], keys_new[1:] != keys_new[:-1]))
        anchor = docs_new[np.flatnonzero(starts)][np.cumsum(starts) - 1]  # the smallest new doc of each key
        uniq = keys_new[starts]
        old_anchor = np.full(len(uniq), -1, np.int64)
        for r in self.runs[: self.old_runs]:  # in order: the earliest run holding a key has its anchor
            todo = np.flatnonzero(old_anchor < 0)
            if not len(todo):
                break
            k = np.load(r / "keys.npy", mmap_mode="r")
            if len(k):
                pos = np.minimum(np.searchsorted(k, uniq[todo]), len(k) - 1)
                hit = np.asarray(k[pos]) == uniq[todo]
                if hit.any():  # a run's records are sorted by (key, doc): the first of a key is its smallest
                    d = np.load(r / "docs.npy", mmap_mode="r")
                    old_anchor[todo[hit]] = d[pos[hit]]
                    del d
            del k  # drop the mapping so its pages leave the resident set
        has_old = (old_anchor >= 0)[np.cumsum(starts) - 1]
        anchor = np.where(has_old, old_anchor[np.cumsum(starts) - 1], anchor)
        sel = (docs_new >= first_new) & (docs_new != anchor)
        edges = unique_edges(np.stack([docs_new[sel], anchor[sel]], axis=1))
        self.queries += 1
        if not len(edges):
            return
        blocks = (edges[:, 0] - first_new) // block
        cuts = np.flatnonzero(np.concatenate(([True], blocks[1:] != blocks[:-1]))).tolist()
        for s, e in zip(cuts, [*cuts[1:], len(edges)], strict=True):
            yield edges[s:e]
