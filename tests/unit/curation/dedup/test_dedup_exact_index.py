"""The exact-hash index lives on disk: memory per shard, not per corpus, and the same decisions."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np

from llmpipe.curation.dedup.core import ExactIndex

SHARD = 20_000


def _shards(n_shards: int, seed: int = 0) -> list[np.ndarray]:
    """Hashes per shard; ~5% repeat a hash of an earlier shard, ~1% repeat one of the same shard."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    for _ in range(n_shards):
        h = rng.integers(0, 2**63, SHARD, dtype=np.uint64)
        if out:
            old = np.concatenate(out)
            pick = rng.random(SHARD) < 0.05
            h[pick] = old[rng.integers(0, len(old), int(pick.sum()))]
        inner = np.flatnonzero(rng.random(SHARD) < 0.01)
        h[inner] = h[rng.integers(0, SHARD, len(inner))]
        out.append(h)
    return out


def _reference(shards: list[np.ndarray]) -> list[np.ndarray]:
    """First document with each hash, by a dict over the whole corpus."""
    first_of: dict[int, int] = {}
    targets, base = [], 0
    for h in shards:
        t = np.full(len(h), -1, np.int64)
        for row, v in enumerate(h.tolist()):
            doc = first_of.setdefault(v, base + row)
            if doc != base + row:
                t[row] = doc
        targets.append(t)
        base += len(h)
    return targets


def test_exact_index_decides_like_a_dict(tmp_path: Path) -> None:
    shards = _shards(6)
    index, base = ExactIndex(tmp_path / "exact"), 0
    for h, want in zip(shards, _reference(shards), strict=True):
        got = index.lookup_and_add(base, h)
        assert np.array_equal(got, want)
        base += len(h)
    assert (want >= 0).sum() > 0.04 * SHARD  # the planted repeats were found


def _lookup_peak(tmp_path: Path, n_shards: int) -> int:
    """Peak traced bytes of deciding one more shard after ``n_shards`` shards."""
    shards = _shards(n_shards + 1, seed=n_shards)
    index, base = ExactIndex(tmp_path / f"exact-{n_shards}"), 0
    for h in shards[:-1]:
        index.lookup_and_add(base, h)
        base += len(h)
    tracemalloc.start()
    try:
        index.lookup_and_add(base, shards[-1])
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_exact_index_memory_is_per_shard(tmp_path: Path) -> None:
    """Deciding a shard after 40 shards takes the memory it takes after 5: an in-memory index of
    16 bytes a document (plus its sort's copies) would hold 12.8 MB at 800k documents, 8x 1.6 MB."""
    small, large = _lookup_peak(tmp_path, 5), _lookup_peak(tmp_path, 40)
    print(f"peak traced memory: {small / 2**20:.2f} MiB after 5 shards, {large / 2**20:.2f} MiB after 40")
    assert large < 1.3 * small + (1 << 18), (small, large)
    assert large < 40 * SHARD * 16 / 4, large  # a few arrays of one shard, not the corpus's 40 x 20k x 16 bytes
