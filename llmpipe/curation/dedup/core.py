"""Dedup decisions over shards of signatures: exact first, then MinHash LSH near-duplicates.

The rule (deterministic, and the reason a refresh equals a full recompute):

- documents are ordered by (shard order, row); a refresh's new shards come after the old ones;
- a document is an **exact duplicate** if an earlier document has the same normalized-text hash;
- otherwise it is a **near duplicate** if an earlier, exact-unique document shares an LSH band
  with it and (with ``verify``) their signatures agree on >= ``threshold`` of the values;
- its parent is the earliest such document; following parents ends at a kept document, its
  **keeper**, whose id goes to ``metadata["duplicate_of"]``. Links only point backwards, so the
  clusters are union-find trees whose root is the cluster's earliest document, and a later
  document never changes an earlier decision: a refresh only decides its new documents.

Plain union-find over undirected pairs would let one new document bridge two clusters whose
keepers are unrelated (and flip an already published decision); the backward rule avoids both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmpipe.curation.dedup.lsh import signature_agreement

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
    """Normalized-text hashes of exact-unique documents -> the global index of that document."""

    def __init__(self, hashes: np.ndarray | None = None, docs: np.ndarray | None = None) -> None:
        h = hashes if hashes is not None else np.zeros(0, np.uint64)
        d = docs if docs is not None else np.zeros(0, np.int64)
        order = np.argsort(h, kind="stable")
        self.hashes, self.docs = h[order], d[order]

    def lookup_and_add(self, first: int, hashes: np.ndarray) -> np.ndarray:
        """For one shard's hashes: target global index of an earlier same-text doc, or -1."""
        target = np.full(len(hashes), -1, dtype=np.int64)
        if len(self.hashes):
            pos = np.minimum(np.searchsorted(self.hashes, hashes), len(self.hashes) - 1)
            hit = self.hashes[pos] == hashes
            target[hit] = self.docs[pos[hit]]
        fresh = np.flatnonzero(target < 0)
        if len(fresh):
            uniq, first_pos, inverse = np.unique(hashes[fresh], return_index=True, return_inverse=True)
            owner = fresh[first_pos][inverse]  # the first row in this shard with the same hash
            repeat = owner != fresh
            target[fresh[repeat]] = first + owner[repeat]
            new_h = uniq
            new_d = first + fresh[first_pos]
            merged_h = np.concatenate([self.hashes, new_h])
            merged_d = np.concatenate([self.docs, new_d])
            order = np.argsort(merged_h, kind="stable")
            self.hashes, self.docs = merged_h[order], merged_d[order]
        return target


def resolve_parents(new_idx: np.ndarray, pairs: np.ndarray, sigs: SigStore, threshold: float,
                    verify: bool, batch: int = 1 << 16) -> tuple[np.ndarray, int]:
    """Earliest verified earlier neighbour of each new exact-unique doc (-1: none); pairs verified."""
    parent = np.full(len(new_idx), -1, dtype=np.int64)
    if not len(pairs):
        return parent, 0
    verified = 0
    for s in range(0, len(pairs), batch):
        chunk = pairs[s : s + batch]
        if verify:
            agree = signature_agreement(sigs.gather(chunk[:, 0]), sigs.gather(chunk[:, 1]))
            chunk = chunk[agree >= threshold - 1e-12]
        verified += len(chunk)
        if not len(chunk):
            continue
        pos = np.searchsorted(new_idx, chunk[:, 0])
        cur = parent[pos]
        better = (cur < 0) | (chunk[:, 1] < cur)
        # several pairs may hit one doc in a chunk: keep the minimum with a sort
        sel = np.flatnonzero(better)
        order = np.lexsort((chunk[sel, 1], pos[sel]))
        p_sorted, i_sorted = pos[sel][order], chunk[sel, 1][order]
        firsts = np.concatenate(([True], p_sorted[1:] != p_sorted[:-1])) if len(p_sorted) else []
        parent[p_sorted[firsts]] = i_sorted[firsts]
    return parent, verified


def assign_keepers(new_idx: np.ndarray, parent: np.ndarray, old_keeper: Callable[[int], int]) -> np.ndarray:
    """Keeper of each new exact-unique doc: itself, or its parent's keeper (parents are earlier)."""
    keeper = new_idx.copy()
    for k in np.flatnonzero(parent >= 0):
        p = int(parent[k])
        kp = int(np.searchsorted(new_idx, p))
        keeper[k] = keeper[kp] if kp < len(new_idx) and new_idx[kp] == p else old_keeper(p)
    return keeper
