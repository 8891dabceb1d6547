"""The memory backend's persisted index: a base pickle plus append-only deltas, compacted when they grow."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dedup.lsh import COMPACT_RATIO, DatasketchIndex
from llmpipe.document import Document
from llmpipe.store import ArtifactStore
from tests.fixtures.dedup_runs import planted_pair, publish_input, run_dedup, words
from tests.unit.curation.dedup.test_dedup_stage import _decisions


def _tables(index: DatasketchIndex) -> tuple[list[dict], dict]:
    """Every bucket's documents per band, and every document's bucket keys (public storage API)."""
    lsh = index.lsh
    return ([{h: set(t.get(h)) for h in t.keys()} for t in lsh.hashtables],
            {k: list(lsh.keys.get(k)) for k in lsh.keys.keys()})


def test_bulk_insert_stores_what_minhashlsh_insert_stores(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sigs = rng.integers(0, 2**32, size=(300, 128), dtype=np.uint32)
    sigs[200:210] = sigs[:10]  # shared buckets: sets with several keys
    idx = np.arange(300, dtype=np.int64) * 3
    ref = DatasketchIndex.create(0.8, 128, (16, 8), seed=1)
    ref.add_and_query(idx, sigs, query=False)
    # base = the first 100 docs, then two deltas
    d = tmp_path / "a"
    d.mkdir()
    first = DatasketchIndex.create(0.8, 128, (16, 8), seed=1)
    first.add_and_query(idx[:100], sigs[:100], query=False)
    first.save(d)
    prev = d
    for k, (lo, hi) in enumerate([(100, 110), (110, 120)]):
        nxt = tmp_path / f"r{k}"
        nxt.mkdir()
        got = DatasketchIndex.load(prev, 1, None, 0.8, 128, (16, 8))
        got.add_and_query(idx[lo:hi], sigs[lo:hi], query=False)
        got.save(nxt)
        prev = nxt
    meta = json.loads((prev / "lsh.json").read_text())
    assert [x["docs"] for x in meta["deltas"]] == [10, 10] and meta["base"]["docs"] == 100
    assert (prev / "lsh.pkl").stat().st_ino == (d / "lsh.pkl").stat().st_ino  # linked, not rewritten
    loaded = DatasketchIndex.load(prev, 1, None, 0.8, 128, (16, 8))
    loaded.add_and_query(idx[120:], sigs[120:], query=False)
    assert _tables(loaded) == _tables(ref)
    for k in (0, 205, 299):
        q = ref._lean(sigs[k])
        assert sorted(loaded.lsh.query(q)) == sorted(ref.lsh.query(q))
    # a delta into an empty base still records the scheme, so queries keep working
    empty = DatasketchIndex.create(0.8, 128, (16, 8), seed=1)
    empty.bulk_insert(idx[:5], sigs[:5, :128])
    assert 0 in empty.lsh.query(ref._lean(sigs[0]))


def test_nightly_refreshes_link_the_base_and_compact(tmp_path: Path) -> None:
    rng = random.Random(4)
    old = []
    nights: list[list[Document]] = [[]]
    for k in range(200):
        a, b = planted_pair(rng, 120, rng.randint(0, 6))
        old.append(a)
        nights[0].append(Document(f"b{k}", a, "t", {}))
    for night, n in enumerate([10, 10, 60], start=1):  # the third night's deltas pass COMPACT_RATIO
        nights.append([Document(f"n{night}-{k}", (rng.choice(old) + " tail") if k % 3 == 0
                                else " ".join(words(rng, 100)), "t", {}) for k in range(n)])
    assert 20 <= COMPACT_RATIO * 200 < 80
    cfg = DedupConfig(threshold=0.8)
    store = ArtifactStore(tmp_path / "s")
    shards: dict[str, list[Document]] = {}
    base_ino = None
    for night, docs in enumerate(nights):
        shards[f"part-{night:03d}.parquet"] = docs
        art = run_dedup(store, publish_input(store, dict(shards)), cfg)
        meta = json.loads((art.path / "index" / "lsh.json").read_text())
        ino = (art.path / "index" / "lsh.pkl").stat().st_ino
        if night in (1, 2):
            assert ino == base_ino and len(meta["deltas"]) == night
            assert art.stats["lsh_inserts"] == meta["deltas"][-1]["docs"] <= len(docs)
        if night == 3:
            assert ino != base_ino and meta["deltas"] == [] and meta["base"]["docs"] > 200
        base_ino = ino
        full_store = ArtifactStore(tmp_path / f"full{night}")
        full = run_dedup(full_store, publish_input(full_store, dict(shards)), cfg)
        assert _decisions(art.path) == _decisions(full.path)
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
    assert "index/lsh.pkl" in linked and "index/shards/part-000/sig.npy" in linked
    assert not linked & set(hashed) and "index/lsh-delta-00000.npz" in hashed
