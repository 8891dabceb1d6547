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

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEPT, EXACT, NEAR = 0, 1, 2
REASONS = {EXACT: "exact_duplicate", NEAR: "near_duplicate"}


@dataclass
class Segment:
    """One shard's slice of the global order and the ``.npy`` file holding its signatures."""

    first: int
    n: int
    path: Path  # (n, num_perm) uint32


class SigStore:
    """The shards' signature files in global order (a refresh rebuilds the memory index from them)."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = sorted(segments, key=lambda s: s.first)

    def add(self, seg: Segment) -> None:
        self.segments.append(seg)


class ExactIndex:
    """Normalized-text hashes of exact-unique documents -> the global index of that document.

    On disk, out of core: sorted runs of ``(hash, doc)`` in ``folder`` (each hash is in exactly one
    run: the earliest document's), merged LSM-style: a shard adds a run, and while the run before
    the last is at most twice the last's size the two are merged (a streaming merge, ``chunk``
    records of each run at a time). Run sizes then fall at least geometrically, so a corpus of S
    shards holds O(log S) runs and a lookup reads O(log S) runs (one run per shard made a lookup
    read every earlier shard's run: S^2 / 2 run reads in all, ~5,000 at 100 shards), and each
    record is rewritten O(log S) times. A lookup memory-maps each run in turn and drops the mapping,
    so memory holds a shard's arrays and a merge chunk whatever the corpus size.
    """

    def __init__(self, folder: Path, chunk: int = 1 << 16) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.sizes: list[int] = []  # records per run, oldest (largest) first
        self.names: list[int] = []  # each run's file number
        self.made = 0  # runs written, merged ones included (file numbers)
        self.chunk = chunk
        self.run_reads = 0  # runs searched by lookups (a test bounds them)
        self.merged_records = 0  # records rewritten by merges

    @property
    def runs(self) -> int:
        return len(self.sizes)

    def _path(self, name: int, part: str) -> Path:
        return self.folder / f"{name:08d}-{part}.bin"

    def _open(self, name: int, part: str) -> np.ndarray:
        return np.memmap(self._path(name, part), dtype=np.uint64 if part == "h" else np.int64, mode="r")

    def add_run(self, hashes: np.ndarray, docs: np.ndarray) -> None:
        """Register distinct hashes (not in any earlier run) of the documents ``docs``."""
        if not len(hashes):
            return
        order = np.argsort(hashes, kind="stable")
        name = self.made
        np.asarray(hashes, np.uint64)[order].tofile(self._path(name, "h"))
        np.asarray(docs, np.int64)[order].tofile(self._path(name, "d"))
        self.made += 1
        self.sizes.append(len(hashes))
        self.names.append(name)
        while len(self.sizes) > 1 and self.sizes[-2] <= 2 * self.sizes[-1]:
            self._merge_last_two()

    def _merge_last_two(self) -> None:
        """Merge the two newest runs into one, ``chunk`` records of each at a time (bounded memory)."""
        a, b = self.names[-2], self.names[-1]
        name = self.made
        self.made += 1
        ha, hb, da, db = self._open(a, "h"), self._open(b, "h"), self._open(a, "d"), self._open(b, "d")
        ia = ib = 0
        with open(self._path(name, "h"), "wb") as fh, open(self._path(name, "d"), "wb") as fd:
            while ia < len(ha) or ib < len(hb):
                # every record up to the smallest last hash of a window that does not reach its
                # run's end: no record after a window can sort before it, so the output is in order
                ea, eb = min(ia + self.chunk, len(ha)), min(ib + self.chunk, len(hb))
                ends = [x[e - 1] for x, e in ((ha, ea), (hb, eb)) if e < len(x)]
                if ends:
                    cut = min(ends)
                    ja = int(np.searchsorted(ha[ia:ea], cut, side="right")) + ia
                    jb = int(np.searchsorted(hb[ib:eb], cut, side="right")) + ib
                else:
                    ja, jb = ea, eb
                h = np.concatenate([ha[ia:ja], hb[ib:jb]])
                order = np.argsort(h, kind="stable")
                h[order].tofile(fh)
                np.concatenate([da[ia:ja], db[ib:jb]])[order].tofile(fd)
                ia, ib = ja, jb
        del ha, hb, da, db  # drop the mappings before the files go
        for old in (a, b):
            self._path(old, "h").unlink()
            self._path(old, "d").unlink()
        self.merged_records += self.sizes[-2] + self.sizes[-1]
        self.sizes[-2:] = [self.sizes[-2] + self.sizes[-1]]
        self.names[-2:] = [name]

    def _lookup(self, hashes: np.ndarray) -> np.ndarray:
        target = np.full(len(hashes), -1, dtype=np.int64)
        for name in self.names:
            self.run_reads += 1
            h = self._open(name, "h")
            pos = np.minimum(np.searchsorted(h, hashes), len(h) - 1)
            hit = np.flatnonzero((np.asarray(h[pos]) == hashes) & (target < 0))
            if len(hit):
                d = self._open(name, "d")
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
    """Exact Jaccard of two documents by global index, from shingle sets computed once, to a file.

    Before the decisions, :meth:`build` computes the hashed set (:func:`hashed_set`) of every
    document the verification can touch (:func:`needed`: the members with an edge, their anchors,
    the keepers of an earlier artifact's anchors) shard by shard, each shard's text read once and
    in order, and appends the sets to one file on disk; a Jaccard then reads its two sets back
    (one ``pread`` each, from the page cache). Why: the decisions walk the members in order while
    their keepers sit anywhere earlier, so reading texts on demand read a keeper's shard once per
    block of edges: shards x blocks, which grew with the square of the corpus (30 -> 208 shard
    reads for 100k -> 500k documents). Now the reads are the shards holding a needed document
    (at most every shard once) and the memory one shard's text column plus the needed documents'
    offsets (16 bytes each), whatever the corpus.
    """

    def __init__(self, shingle: Callable[[str, str | None], list[bytes]], folder: Path) -> None:
        self.shingle = shingle
        self.folder = folder
        self.files: list[tuple[int, Path]] = []
        self.docs = np.zeros(0, np.int64)  # the documents whose sets the file holds, ascending
        self.offsets = np.zeros(1, np.int64)  # set i: file bytes offsets[i] .. offsets[i + 1]
        self._fd: int | None = None
        self.computed = 0  # Jaccard values computed (the stage's ``edges_verified``)
        self.reads = 0  # shard text columns read (the stage's ``verify_shard_reads``)

    def add(self, first: int, path: Path) -> None:
        """Register the next shard (in order): its first global index and its path."""
        self.files.append((first, path))

    def build(self, docs: np.ndarray) -> None:
        """Compute the sets of ``docs`` (ascending distinct global indexes), each shard read once."""
        from llmpipe.document import load_metadata, read_columns

        self.folder.mkdir(parents=True, exist_ok=True)
        self.docs = np.asarray(docs, np.int64)
        sizes = np.zeros(len(self.docs), np.int64)
        firsts = np.array([f for f, _ in self.files] + [np.iinfo(np.int64).max], np.int64)
        cuts = np.searchsorted(self.docs, firsts)
        with open(self.folder / "sets.bin", "wb") as out:
            for k, (first, path) in enumerate(self.files):
                lo, hi = int(cuts[k]), int(cuts[k + 1])
                if lo == hi:
                    continue
                t = read_columns(path, ["text", "metadata"])
                self.reads += 1
                text, meta = t.column("text"), t.column("metadata")
                for i in range(lo, hi):
                    row = int(self.docs[i]) - first
                    m = meta[row].as_py()
                    lang = load_metadata(m).get("lang") if m else None
                    got = hashed_set(self.shingle(text[row].as_py(), lang if isinstance(lang, str) else None))
                    out.write(got.tobytes())
                    sizes[i] = got.nbytes
                del t, text, meta
        self.offsets = np.concatenate(([0], np.cumsum(sizes)))
        self._fd = os.open(self.folder / "sets.bin", os.O_RDONLY)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def get(self, idx: int) -> np.ndarray:
        """Document ``idx``'s hashed set (it must be one :meth:`build` was given)."""
        i = int(np.searchsorted(self.docs, idx))
        if i >= len(self.docs) or self.docs[i] != idx or self._fd is None:
            raise KeyError(f"no shingle set built for document {idx}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.frombuffer(os.pread(self._fd, b - a, a), np.uint64) if b > a else np.zeros(0, np.uint64)

    def jaccard(self, a: int, b: int) -> float:
        """Exact Jaccard of documents ``a`` and ``b``."""
        self.computed += 1
        return exact_jaccard(self.get(a), self.get(b))


def needed(edges: np.ndarray, first_new: int, keeper_of_old: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The documents whose sets verifying these edges can read, distinct and ascending: each member
    ``j``, each new anchor (kept: itself; removed: a member here, whose keeper is needed by the same
    rule), and the keeper of each earlier artifact's anchor. A keeper :func:`decide_near` picks is
    one of these, by induction over the members in order."""
    anchors = edges[:, 1]
    old = anchors < first_new
    return np.unique(np.concatenate([edges[:, 0], anchors[~old], keeper_of_old(anchors[old])]))


class EdgeSpill:
    """Candidate edge arrays written to one file as they stream in, read back as the same arrays.

    The verification needs every document it can touch before the first decision (:meth:`ShingleSets.build`)
    and the decisions need the edges in order: one pass over the index's stream fills this and the
    needed documents, a second pass reads the edges back. 16 bytes an edge on disk, at most
    ``bands`` edges a document; in memory one length per array.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lengths: list[int] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(path, "wb")  # noqa: SIM115  (closed by the first read)

    def add(self, chunk: np.ndarray) -> None:
        if len(chunk):
            self._out.write(np.ascontiguousarray(chunk, np.int64).tobytes())
            self.lengths.append(len(chunk))

    def __iter__(self) -> Iterator[np.ndarray]:
        self._out.close()
        with open(self.path, "rb") as f:
            for n in self.lengths:
                yield np.frombuffer(f.read(n * 16), np.int64).reshape(n, 2)


def decide_near(edges: Iterable[np.ndarray], keeper_of_old: Callable[[int], int], keepers: np.ndarray,
                first_new: int, jaccard: Callable[[int, int], float] | None, threshold: float) -> int:
    """Set ``keepers[j - first_new]`` of each new document ``j`` with edges that joins a set; returns the edges seen.

    ``keepers``: by global index - ``first_new``, each new document's own index on entry.
    ``edges``: (j, anchor) arrays in ascending j (each array sorted, arrays in order, no j split
    across arrays), as :func:`anchor_edges` gives them; ``jaccard`` None: unverified (``verify:
    false``). See the module docstring for the rule. Documents without an edge keep themselves.
    """
    def keeper(i: int) -> int:
        return int(keepers[i - first_new]) if i >= first_new else keeper_of_old(i)

    seen = 0
    for chunk in edges:
        seen += len(chunk)
        if not len(chunk):
            continue
        js = chunk[:, 0]
        bounds = np.flatnonzero(np.concatenate(([True], js[1:] != js[:-1], [True])))
        for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            j = int(js[s])
            for k in sorted({keeper(int(a)) for a in chunk[s:e, 1]}):
                if jaccard is None or jaccard(j, k) >= threshold - 1e-12:
                    keepers[j - first_new] = k
                    break
    return seen
