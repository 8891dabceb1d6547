"""The dedup stage's reads grow with the corpus, not its square: counted at S and 4S shards.

Each used to grow with S^2: the exact-hash index searched every earlier shard's run (S^2 / 2 run
reads), the verification read a keeper's shard once per block of edges, and the keeper ids a
shard once per output shard naming it. Exact and near copies of documents anywhere earlier put
keepers in every shard, which is what made those reads quadratic.
"""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest

from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dedup.core import ExactIndex
from llmpipe.document import Document
from tests.fixtures.dedup_runs import publish_input, run_dedup, words

PER_SHARD = 12


def _files(n_shards: int, seed: int) -> dict[str, list[Document]]:
    """Shards of 200-word documents; from the third shard on, two exact copies and two near copies
    (one word changed) of documents in random earlier shards."""
    rng = random.Random(seed)
    texts: list[list[str]] = []
    files: dict[str, list[Document]] = {}
    for s in range(n_shards):
        docs = []
        for r in range(PER_SHARD):
            if s >= 2 and r < 2:
                text = list(texts[rng.randrange(len(texts) - r)])
            elif s >= 2 and r < 4:
                text = [*texts[rng.randrange(len(texts) - r)][:-1], f"changed{s}-{r}"]
            else:
                text = words(rng, 200)
            texts.append(text)
            docs.append(Document(f"d{s}-{r}", " ".join(text), "t", {}))
        files[f"part-{s:03d}.parquet"] = docs
    return files


def _stats(store, n_shards: int, backend: str) -> dict:
    files = _files(n_shards, seed=n_shards)
    art = run_dedup(store, publish_input(store, files), DedupConfig(backend=backend, incremental=False))
    st = art.stats
    assert st["rejected_exact_duplicate"] == 2 * (n_shards - 2), st
    assert st["rejected_near_duplicate"] == 2 * (n_shards - 2), st
    return st


@pytest.mark.parametrize("backend", ["memory", "external"])
def test_reads_grow_linearly_with_the_shards(store, backend: str) -> None:
    """10 -> 40 shards: the verification and the keeper ids read each shard at most once (4x), the
    exact index O(log S) runs a lookup (one run per shard: 45 -> 780 run reads, 17x)."""
    small, large = _stats(store, 10, backend), _stats(store, 40, backend)
    keys = ("verify_shard_reads", "id_shard_reads", "exact_run_reads")
    print(backend, {k: (small[k], large[k]) for k in keys})
    for k in ("verify_shard_reads", "id_shard_reads"):
        assert small[k] <= 10 and large[k] <= 40, (k, small[k], large[k])
    assert large["exact_run_reads"] <= 40 * (math.log2(40) + 1), large["exact_run_reads"]
    assert large["exact_run_reads"] <= 8 * small["exact_run_reads"], (small["exact_run_reads"], large["exact_run_reads"])


def test_exact_index_merges_runs_and_decides_like_a_dict() -> None:
    """Runs of varied sizes (some empty), merged a few records at a time: every decision equals a
    dict's over the whole corpus, each run stays sorted, and the runs stay O(log S)."""
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as tmp:
        index, first_of, base = ExactIndex(Path(tmp), chunk=7), {}, 0
        for s in range(200):
            h = rng.integers(0, 3000, int(rng.integers(0, 60))).astype(np.uint64)  # repeats within and across
            want = np.full(len(h), -1, np.int64)
            for row, v in enumerate(h.tolist()):
                if first_of.setdefault(v, base + row) != base + row:
                    want[row] = first_of[v]
            assert np.array_equal(index.lookup_and_add(base, h), want), s
            base += len(h)
            assert index.runs <= math.log2(s + 1) + 2, (s, index.sizes)
        for name, size in zip(index.names, index.sizes, strict=True):
            hashes = np.fromfile(Path(tmp) / f"{name:08d}-h.bin", np.uint64)
            assert len(hashes) == size and (hashes[1:] > hashes[:-1]).all()
        assert sum(index.sizes) == len(first_of)
