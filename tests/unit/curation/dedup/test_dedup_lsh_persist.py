"""The persisted index across refreshes: rebuilt from per-shard files, so a refresh writes what a cold run writes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dedup.lsh import DatasketchIndex
from llmpipe.document import Document
from llmpipe.store import ArtifactStore
from tests.fixtures.dedup_runs import planted_pair, publish_input, run_dedup, words
from tests.unit.curation.dedup.test_dedup_stage import _decisions


def _tables(index: DatasketchIndex) -> tuple[list[dict], dict]:
    """Every bucket's documents per band, and every document's bucket keys (public storage API)."""
    lsh = index.lsh
    return ([{h: set(t.get(h)) for h in t.keys()} for t in lsh.hashtables],
            {k: list(lsh.keys.get(k)) for k in lsh.keys.keys()})


def test_bulk_insert_stores_what_minhashlsh_insert_stores() -> None:
    rng = np.random.default_rng(0)
    sigs = rng.integers(0, 2**32, size=(300, 128), dtype=np.uint32)
    sigs[200:210] = sigs[:10]  # shared buckets: sets with several keys
    idx = np.arange(300, dtype=np.int64) * 3
    ref = DatasketchIndex.create(0.8, 128, (16, 8), seed=1)
    ref.add_and_query(idx, sigs, query=False)
    got = DatasketchIndex.create(0.8, 128, (16, 8), seed=1)  # as a refresh rebuilds its old shards
    got.bulk_insert(idx[:100], sigs[:100])
    got.bulk_insert(idx[100:], sigs[100:])
    assert _tables(got) == _tables(ref)
    for k in (0, 205, 299):
        q = ref._lean(sigs[k])
        assert sorted(got.lsh.query(q)) == sorted(ref.lsh.query(q))


def _files(root: Path) -> dict[str, bytes]:
    """Every file of an artifact but its manifest (which holds the run's timings), by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


@pytest.mark.parametrize("backend", ["memory", "external"])
def test_nightly_refreshes_write_the_same_bytes_as_a_cold_run(tmp_path: Path, backend: str) -> None:
    """Same key, same bytes: after each night's refresh, every file equals a cold run's on the same shards."""
    rng = random.Random(4)
    old = []
    nights: list[list[Document]] = [[]]
    for k in range(200):
        a, _b = planted_pair(rng, 120, rng.randint(0, 6))
        old.append(a)
        nights[0].append(Document(f"b{k}", a, "t", {}))
    for night, n in enumerate([10, 60], start=1):
        nights.append([Document(f"n{night}-{k}", (rng.choice(old) + " tail") if k % 3 == 0
                                else " ".join(words(rng, 100)), "t", {}) for k in range(n)])
    cfg = DedupConfig(threshold=0.8, backend=backend, memory_budget_mb=0.05)
    store = ArtifactStore(tmp_path / "s")
    shards: dict[str, list[Document]] = {}
    for night, docs in enumerate(nights):
        shards[f"part-{night:03d}.parquet"] = docs
        art = run_dedup(store, publish_input(store, dict(shards)), cfg)
        assert art.stats["shards_reused"] == night and art.stats["lsh_inserts"] <= len(docs)
        full_store = ArtifactStore(tmp_path / f"full{night}")
        full = run_dedup(full_store, publish_input(full_store, dict(shards)), cfg)
        assert full.key == art.key and full.stats["shards_reused"] == 0
        got, want = _files(art.path), _files(full.path)
        assert sorted(got) == sorted(want)
        assert [rel for rel in want if got[rel] != want[rel]] == []
        assert art.manifest["files"] == full.manifest["files"]
    assert sum(v[0] == "near_duplicate" for v in _decisions(art.path).values()) >= 20


def test_refresh_publish_reuses_digests_of_linked_files(tmp_path: Path, monkeypatch) -> None:
    """Files linked from the previous artifact keep its sha256; new files are hashed; all digests are right."""
    import llmpipe.store as store_mod

    rng = random.Random(6)
    shards = {f"part-{k:03d}.parquet": [Document(f"d{k}-{i}", " ".join(words(rng, 80)), "t", {}) for i in range(40)]
              for k in range(3)}
    store = ArtifactStore(tmp_path / "s")
    cfg = DedupConfig(threshold=0.8)
    prev = run_dedup(store, publish_input(store, shards), cfg)
    shards["part-003.parquet"] = [Document(f"n{i}", " ".join(words(rng, 80)), "t", {}) for i in range(5)]
    inp = publish_input(store, shards)
    hashed: list[str] = []
    real = store_mod.sha256_file

    def counting(path, *a, **k):  # the real hash, counted
        hashed.append(Path(path).relative_to(store.path("dedup", "x").parent).as_posix().split("/", 1)[1])
        return real(path, *a, **k)

    monkeypatch.setattr(store_mod, "sha256_file", counting)
    inc = run_dedup(store, inp, cfg)
    files = inc.manifest["files"]
    for rel, info in files.items():
        assert info["sha256"] == real(inc.path / rel), rel
    linked = {rel for rel in files if rel in prev.manifest["files"]
              and (inc.path / rel).stat().st_ino == (prev.path / rel).stat().st_ino}
    assert "index/shards/part-000/sig.npy" in linked and "shards/part-000.parquet" in linked
    assert not linked & set(hashed) and "index/shards/part-003/docs.parquet" in hashed


def test_external_refresh_lookup_gives_the_partition_scans_edges(tmp_path: Path) -> None:
    """A refresh's binary search of the old runs yields the edges of the full scan, in ascending j."""
    from llmpipe.curation.dedup.lsh import ExternalIndex

    rng = np.random.default_rng(3)
    sigs = rng.integers(0, 4, size=(900, 16), dtype=np.uint32)  # 4 values a row: buckets of many members
    sigs[850:] = rng.integers(4, 2**32, size=(50, 16), dtype=np.uint32)  # buckets only new docs share:
    sigs[880:] = sigs[850:870]  # their anchors are new documents
    old_runs = []
    builder = ExternalIndex([], 8, 2, 512)
    for s in range(3):  # three old shards, exact-unique rows only (every other one)
        rows = np.arange(s * 250, (s + 1) * 250)[:: 1 + s % 2]
        builder.write_run(tmp_path / f"old{s}", rows, sigs[rows])
        old_runs.append(tmp_path / f"old{s}")

    def edges(budget_mb: float) -> list[np.ndarray]:
        index = ExternalIndex(old_runs, 8, 2, budget_mb)
        index.write_run(tmp_path / f"new-{budget_mb}", np.arange(750, 900), sigs[750:900])
        return list(index.query_new(750, 900, tmp_path / f"spill-{budget_mb}"))

    lookup, scan = edges(512), edges(0.01)  # 0.01 MB: the new records do not fit, the runs are scanned
    assert len(scan) > 1  # the scan's blocks are smaller (the budget sizes them): compare the edges
    got = np.concatenate(lookup)
    np.testing.assert_array_equal(got, np.concatenate(scan))
    assert (got[:, 1] < 750).any() and (got[:, 1] >= 750).any()  # anchors in old runs and in the new one


def test_memory_refresh_index_of_bucket_mates_gives_the_rebuilt_indexs_edges(tmp_path: Path) -> None:
    """A refresh inserts only the old documents that share a band key with a new one: same anchors."""
    from llmpipe.curation.dedup.stage import _bucket_mates, _new_band_keys

    rng = np.random.default_rng(5)
    sigs = rng.integers(0, 3, size=(700, 32), dtype=np.uint32)  # 3 values a row: crowded buckets
    sigs[650:] = rng.integers(3, 2**32, size=(50, 32), dtype=np.uint32)
    sigs[690:] = sigs[660:670]  # buckets only new documents share
    params = {"bands": 8, "rows": 4}
    new_idx = np.arange(600, 700, dtype=np.int64)

    def edges(old_rows: np.ndarray) -> np.ndarray:
        index = DatasketchIndex.create(0.5, 32, (8, 4), seed=1)
        index.bulk_insert(old_rows, sigs[old_rows])
        return index.add_and_query(new_idx, sigs[600:])

    np.save(tmp_path / "sig.npy", sigs[600:])
    mates = _bucket_mates(sigs[:600], _new_band_keys([tmp_path / "sig.npy"], params), params)
    assert 0 < len(mates) < 600
    got, want = edges(mates.astype(np.int64)), edges(np.arange(600, dtype=np.int64))
    np.testing.assert_array_equal(got, want)
    assert (want[:, 1] < 600).any() and (want[:, 1] >= 600).any()
