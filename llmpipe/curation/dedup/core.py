"""Dedup decisions over shards of signatures: exact first, then MinHash LSH near-duplicates.

The rule (deterministic, and the reason a refresh equals a full recompute):

- documents are ordered by (shard order, row); a refresh's new shards come after the old ones;
- a document is an **exact duplicate** if an earlier document has the same normalized-text hash;
- **candidates**: each exact-unique document ``j`` gets one edge per LSH band whose bucket holds an
  earlier document: the edge to that bucket's **anchor**, its smallest (earliest) member. So a
  document has at most ``bands`` edges and a bucket of ``m`` members ``m - 1``: candidates grow
  linearly with the corpus, where every pair of a bucket grows with its square (2,000 templated
  pages: ~2,000 edges instead of ~2 million pairs). The anchor is the minimum of the bucket, so a
  later document never changes an earlier document's edges;
- **clusters** are union-find sets whose root, the **keeper**, is the set's earliest document.
  Documents are decided in order: ``j``'s candidate keepers are the keepers of its anchors, and
  ``j`` joins the set of the smallest candidate keeper ``k`` whose **exact Jaccard** with it (of
  the two documents' shingle sets, recomputed from their texts) is >= ``threshold``: it is a **near
  duplicate** and ``metadata["duplicate_of"]`` is ``k``. With ``verify: false`` the smallest
  candidate keeper is taken without the Jaccard;
- a document that verifies against none of its candidate keepers **stays** (it is kept and becomes
  the keeper of a set of its own, which later documents can join). So every removed document has
  Jaccard >= ``threshold`` with a kept document, and a document is never removed for resembling
  a document that was itself removed.

Links only point backwards and a decision reads only earlier decisions, so a later document never
changes an earlier decision: a refresh only decides its new documents. Plain union-find over
undirected pairs would let one new document bridge two clusters whose keepers are unrelated (and
flip an already published decision); the backward rule avoids both.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KEPT, EXACT, NEAR = 0, 1, 2
REASONS = {EXACT: "exact_duplicate", NEAR: "near_duplicate"}


@dataclass
class Segment:
    """One shard's slice of the global order and the ``.npy`` file holding its signatures."""

    first: int
    n: int
    path: Path  # (n, num_perm) uint32

    def open(self) -> np.ndarray:
        return np.load(self.path, mmap_mode="r")


class SigStore:
    """Signatures by global document index across segments.

    Each gather maps the file, copies the rows it needs and drops the mapping, so the pages it
    touched leave the resident set: memory stays bounded by the batch, not by the corpus.
    """

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = sorted(segments, key=lambda s: s.first)
        self.firsts = np.array([s.first for s in self.segments], dtype=np.int64)

    def add(self, seg: Segment) -> None:
        self.segments.append(seg)
        self.firsts = np.append(self.firsts, seg.first)

    def gather(self, idx: np.ndarray) -> np.ndarray:
        which = np.searchsorted(self.firsts, idx, side="right") - 1
        num_perm = self.segments[0].open().shape[1]
        out = np.empty((len(idx), num_perm), dtype=np.uint32)
        for w in np.unique(which):
            sel = np.flatnonzero(which == w)
            seg = self.segments[int(w)]
            mm = seg.open()
            out[sel] = mm[idx[sel] - seg.first]
            del mm
        return out


class ExactIndex:
    """Normalized-text hashes of exact-unique documents -> the global index of that document.

    On disk, out of core: one sorted run of ``(hash, doc)`` per shard in ``folder`` (each hash is
    in exactly one run: the earliest document's); a lookup memory-maps each run in turn and drops
    the mapping, so memory holds one shard's arrays whatever the corpus size (16 bytes a document
    in memory would be 32 MB at 2M documents and 16 GB at a billion, plus the sort's copies).
    A lookup reads every run: time grows with shards x shard size (a few seconds at 100 shards).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.runs = 0

    def add_run(self, hashes: np.ndarray, docs: np.ndarray) -> None:
        """Register distinct hashes (not in any earlier run) of the documents ``docs``."""
        if not len(hashes):
            return
        order = np.argsort(hashes, kind="stable")
        np.save(self.folder / f"{self.runs:08d}-h.npy", np.asarray(hashes, np.uint64)[order])
        np.save(self.folder / f"{self.runs:08d}-d.npy", np.asarray(docs, np.int64)[order])
        self.runs += 1

    def _lookup(self, hashes: np.ndarray) -> np.ndarray:
        target = np.full(len(hashes), -1, dtype=np.int64)
        for r in range(self.runs):
            h = np.load(self.folder / f"{r:08d}-h.npy", mmap_mode="r")
            pos = np.minimum(np.searchsorted(h, hashes), len(h) - 1)
            hit = np.flatnonzero((np.asarray(h[pos]) == hashes) & (target < 0))
            if len(hit):
                d = np.load(self.folder / f"{r:08d}-d.npy", mmap_mode="r")
                target[hit] = d[pos[hit]]
                del d
            del h  # drop the mapping so its pages leave the resident set
        return target

    def lookup_and_add(self, first: int, hashes: np.ndarray) -> np.ndarray:
        """For one shard's hashes: target global index of an earlier same-text doc, or -1."""
        hashes = np.asarray(hashes, np.uint64)
        target = self._lookup(hashes)
        fresh = np.flatnonzero(target < 0)
        if len(fresh):
            uniq, first_pos, inverse = np.unique(hashes[fresh], return_index=True, return_inverse=True)
            owner = fresh[first_pos][inverse.ravel()]  # the first row in this shard with the same hash
            repeat = owner != fresh
            target[fresh[repeat]] = first + owner[repeat]
            self.add_run(uniq, first + fresh[first_pos])
        return target


def anchor_edges(keys: np.ndarray, docs: np.ndarray, first_new: int) -> np.ndarray:
    """(j, anchor) for every bucket record of a new document ``j >= first_new`` that is not its
    bucket's anchor; records sorted by (key, doc), so each bucket's first record is its anchor."""
    if not len(keys):
        return np.zeros((0, 2), np.int64)
    starts = np.concatenate(([True], keys[1:] != keys[:-1]))
    anchor = docs[np.flatnonzero(starts)][np.cumsum(starts) - 1]
    sel = (docs >= first_new) & (docs != anchor)
    return unique_edges(np.stack([docs[sel], anchor[sel]], axis=1))


def unique_edges(edges: np.ndarray) -> np.ndarray:
    """Distinct (j, anchor) rows sorted by j then anchor (one edge however many bands agree)."""
    return np.unique(edges, axis=0) if len(edges) else np.zeros((0, 2), np.int64)


SET_BYTES = 4096  # a shingle set held for verification, as 64-bit hashes: ~500 shingles, a guess for sizing


def hashed_set(shingles: Iterable[bytes]) -> np.ndarray:
    """A shingle set as its sorted, distinct 64-bit XXH3 hashes.

    Why hashes: a set of ~300 five-word shingles as Python ``bytes`` in a ``frozenset`` costs ~27 KB,
    as an array 2.4 KB, so a block of candidate keepers ten times larger fits the same budget (the
    verification's shard reads fall with the number of blocks). Two distinct shingles share a hash
    with probability 2^-64, so for two sets of a few hundred shingles the Jaccard differs from the
    one over the strings with odds near 10^-14. XXH3 (the ``xxhash`` that ``datasets`` uses) hashes
    a set in ~0.1 ms where BLAKE2b took ~0.6 ms.
    """
    from xxhash import xxh3_64_intdigest

    items = shingles if isinstance(shingles, list) else list(shingles)
    return np.unique(np.fromiter(map(xxh3_64_intdigest, items), np.uint64, len(items)))


def exact_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard of two sets given as sorted distinct arrays (:func:`hashed_set`); two empty sets: 1."""
    if not len(a) and not len(b):
        return 1.0
    inter = int(np.intersect1d(a, b, assume_unique=True).size)
    return inter / (len(a) + len(b) - inter)


class ShingleSets:
    """Exact Jaccard of two documents by global index: shingle sets recomputed from their texts.

    The texts come from the shards (``(first, path)`` per shard); the most recently used shards' text
    columns are held up to ``max_bytes``. Members are decided in order, so their shards are read one
    after another; keepers can sit anywhere earlier, so :func:`decide_near` hands over a block's
    candidate keepers up front (:meth:`prefetch`): each shard holding some is read once per block,
    not once per keeper, and blocks are sized by edges (:func:`coalesce`), not by documents, so the
    reads grow with the near-duplicate edges, not with corpus x shards. The block's candidates and
    ``cached`` recent keepers are held as hashed sets (:func:`hashed_set`); a member's set is
    computed once and not kept. Memory is bounded by the block and ``max_bytes``, not by the corpus.
    """

    def __init__(self, shingle: Callable[[str, str | None], list[bytes]], max_bytes: int = 256 << 20,
                 cached: int = 1024) -> None:
        self.shingle = shingle
        self.files: list[tuple[int, Path]] = []
        self.firsts: list[int] = []
        self.max_bytes, self.max_sets = max_bytes, cached
        self.columns: OrderedDict[int, tuple[Any, Any]] = OrderedDict()  # shard -> (text, metadata) arrays
        self.sets: OrderedDict[int, np.ndarray] = OrderedDict()  # recent keepers
        self.block: dict[int, np.ndarray] = {}  # the current block's anchors and keepers
        self.computed = 0  # Jaccard values computed (the stage's ``edges_verified``)
        self.reads = 0  # shard reads (the stage's ``verify_shard_reads``)

    def add(self, first: int, path: Path) -> None:
        """Register the next shard (in order): its first global index and its path."""
        self.files.append((first, path))
        self.firsts.append(first)

    def _columns(self, k: int) -> tuple[Any, Any]:
        """Shard ``k``'s text and metadata columns; the most recent shards are held up to ``max_bytes``."""
        if k in self.columns:
            self.columns.move_to_end(k)
            return self.columns[k]
        from llmpipe.document import read_columns

        t = read_columns(self.files[k][1], ["text", "metadata"])
        self.reads += 1
        self.columns[k] = (t.column("text"), t.column("metadata"))
        while len(self.columns) > 1 and sum(a.nbytes + b.nbytes for a, b in self.columns.values()) > self.max_bytes:
            self.columns.popitem(last=False)
        return self.columns[k]

    def _set(self, cols: tuple[Any, Any], row: int) -> np.ndarray:
        from llmpipe.document import load_metadata

        meta = cols[1][row].as_py()
        lang = load_metadata(meta).get("lang") if meta else None
        return hashed_set(self.shingle(cols[0][row].as_py(), lang if isinstance(lang, str) else None))

    def _shard(self, idx: int) -> int:
        return bisect.bisect_right(self.firsts, idx) - 1

    def prefetch(self, idx: Iterable[int]) -> None:
        """Hold the shingle sets of these documents (a block's candidate keepers) until the next prefetch."""
        self.block = {}
        want = sorted(i for i in set(idx) if i not in self.sets)
        for k, group in itertools.groupby(want, key=self._shard):
            cols = self._columns(k)
            for i in group:
                self.block[i] = self._set(cols, i - self.files[k][0])

    def get(self, idx: int, cache: bool = True) -> np.ndarray:
        got = self.block.get(idx)
        if got is None:
            got = self.sets.get(idx)
        if got is not None:
            if idx in self.sets:
                self.sets.move_to_end(idx)
            return got
        k = self._shard(idx)
        got = self._set(self._columns(k), idx - self.files[k][0])
        if cache:
            self.sets[idx] = got
            if len(self.sets) > self.max_sets:
                self.sets.popitem(last=False)
        return got

    def jaccard(self, a: int, b: int) -> float:
        """Exact Jaccard of document ``a`` (read once: not cached) and keeper ``b`` (cached)."""
        self.computed += 1
        return exact_jaccard(self.get(a, cache=False), self.get(b))


def coalesce(edges: Iterable[np.ndarray], max_edges: int) -> Iterator[np.ndarray]:
    """Adjacent edge arrays joined into blocks of at least ``max_edges`` edges (the last may hold fewer).

    The arrays keep :func:`decide_near`'s contract (ascending ``j``, no ``j`` split across arrays), so
    their concatenation does too. Why: a block's candidate keepers are read shard by shard once per
    block; the index yields a block per few thousand documents, mostly with a handful of edges, so
    without this a corpus of S shards costs ~S reads per few thousand documents.
    """
    held: list[np.ndarray] = []
    count = 0
    for chunk in edges:
        if not len(chunk):
            continue
        held.append(chunk)
        count += len(chunk)
        if count >= max_edges:
            yield np.concatenate(held) if len(held) > 1 else held[0]
            held, count = [], 0
    if held:
        yield np.concatenate(held) if len(held) > 1 else held[0]


def decide_near(edges: Iterable[np.ndarray], keeper_of_old: Callable[[int], int], keepers: np.ndarray,
                first_new: int, jaccard: Callable[[int, int], float] | None, threshold: float,
                prefetch: Callable[[Iterable[int]], None] | None = None) -> int:
    """Set ``keepers[j - first_new]`` of each new document ``j`` with edges that joins a set; returns the edges seen.

    ``keepers``: by global index - ``first_new``, each new document's own index on entry.
    ``edges``: (j, anchor) arrays in ascending j (each array sorted, arrays in order, no j split
    across arrays), as :func:`anchor_edges` gives them; ``jaccard`` None: unverified (``verify:
    false``). See the module docstring for the rule. Documents without an edge keep themselves.
    ``prefetch``: called per array with every keeper its documents can pick: its anchors inside the
    array and the (final) keepers of those before it; a keeper picked inside the array is one of
    these, by induction over the array's documents.
    """
    def keeper(i: int) -> int:
        return int(keepers[i - first_new]) if i >= first_new else keeper_of_old(i)

    seen = 0
    for chunk in edges:
        seen += len(chunk)
        if not len(chunk):
            continue
        js = chunk[:, 0]
        if prefetch is not None:  # every keeper the block can pick: its anchors, earlier ones' final keepers
            anchors = np.unique(chunk[:, 1])
            prefetch({*anchors[anchors >= js[0]].tolist(), *(keeper(int(a)) for a in anchors[anchors < js[0]])})
        bounds = np.flatnonzero(np.concatenate(([True], js[1:] != js[:-1], [True])))
        for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            j = int(js[s])
            for k in sorted({keeper(int(a)) for a in chunk[s:e, 1]}):
                if jaccard is None or jaccard(j, k) >= threshold - 1e-12:
                    keepers[j - first_new] = k
                    break
    return seen
