"""Near-dedup cost stays linear in a bucket's size: one boilerplate cluster of templated pages."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dedup.minhash import HAVE_NUMBA, signatures
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
    if HAVE_NUMBA:  # the 3 pages above take the numpy MinHash path, the 2,000 below numba's kernel: load it
        signatures(["warm up the kernel"], backend="numba")
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


@pytest.mark.parametrize("backend", ["memory", "external"])
def test_verification_reads_each_shard_about_once(store, backend: str) -> None:
    """Near copies whose keepers sit in random earlier shards: the verification reads each shard
    holding a document it compares at most once. 40 shards with 4 near copies each took 40 blocks
    of one shard's edges, ~4 keeper shards apiece (plus each member's own shard): 134 reads (93 on
    the external backend); blocks sized by edges read a shard at most once for the keepers in it
    and once for its members (76); the shingle sets built shard by shard up front read each once."""
    rng = random.Random(5)
    n_shards, per_shard = 40, 60
    originals: list[list[str]] = []
    files: dict[str, list[Document]] = {}
    for s in range(n_shards):
        docs = []
        for r in range(per_shard):
            if s >= 4 and r < 4:  # a near copy (one word of 200 changed) of a document anywhere earlier
                src = originals[rng.randrange(0, (s - 1) * per_shard)]
                text = [*src[:-1], f"changed{s}-{r}"]
            else:
                text = words(rng, 200)
            originals.append(text)
            docs.append(Document(f"d{s}-{r}", " ".join(text), "t", {}))
        files[f"part-{s:03d}.parquet"] = docs
    art = run_dedup(store, publish_input(store, files), DedupConfig(backend=backend, memory_budget_mb=1,
                                                                    incremental=False))
    st = art.stats
    assert st["rejected_near_duplicate"] == 4 * (n_shards - 4), st
    print(backend, "verification shard reads", st["verify_shard_reads"])
    assert st["verify_shard_reads"] <= n_shards, st["verify_shard_reads"]
