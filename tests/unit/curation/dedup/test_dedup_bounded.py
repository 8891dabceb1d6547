"""Near-dedup cost stays linear in a bucket's size: one boilerplate cluster of templated pages."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from llmpipe.curation.config import DedupConfig
from llmpipe.document import Document
from tests.fixtures.dedup_runs import publish_input, run_dedup, words

PAGES = 2000


@pytest.mark.parametrize("backend", ["memory", "external"])
def test_bucket_growth_is_linear(store, backend: str) -> None:
    """2,000 pages of the same 300 words, the last one different, share every bucket whose band the
    last shingle does not set: all-pairs candidates were n(n-1)/2 = 1,999,000 (5x that on the
    external backend, 160 MB of pairs); edges to the bucket's anchor are one per page."""
    rng = random.Random(2)
    base = words(rng, 299)
    docs = [Document(f"p{i}", " ".join([*base, f"last{i}"]), "t", {}) for i in range(PAGES)]
    inp = publish_input(store, {"part-000.parquet": docs[: PAGES // 2], "part-001.parquet": docs[PAGES // 2 :]})
    cfg = DedupConfig(backend=backend, memory_budget_mb=1, incremental=False)
    run_dedup(store, publish_input(store, {"warm.parquet": docs[:3]}), cfg)  # the stage's imports, untraced
    tracemalloc.start()
    try:
        art = run_dedup(store, inp, cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    st = art.stats
    assert st["kept"] == 1 and st["rejected_near_duplicate"] == PAGES - 1
    assert st["edges_candidate"] == PAGES - 1, st["edges_candidate"]  # one anchor edge per page, never pairs
    assert st["edges_verified"] == PAGES - 1  # one exact Jaccard per page, against the keeper p0
    print(f"{backend}: peak traced memory {peak / 2**20:.1f} MiB")
    assert peak < 24 * 2**20, f"peak traced memory {peak / 2**20:.1f} MiB (all pairs alone: 32 MiB)"
