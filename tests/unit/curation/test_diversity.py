"""Diversity: planted paraphrase-like near-duplicates (sentences reordered, a few words changed) that
MinHash dedup keeps are removed by the semantic step inside their cluster; a cluster cap holds; the
funnel adds up and every document keeps its cluster and similarity."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from pydoc_data.topics import topics

from llmpipe.curation import diversity as dv
from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dimensions_config import DiversityConfig
from llmpipe.curation.diversity import cluster_cap
from llmpipe.document import Document, read_shard, rejected_paths, shard_paths
from tests.fixtures.quality_corpus import documents, run_stage


def paraphrase(text: str, rng: random.Random, changes: int = 3) -> str:
    """The same sentences in another order, ``changes`` words replaced."""
    sents = re.split(r"(?<=[.!?])\s+", text)
    rng.shuffle(sents)
    words = " ".join(sents).split()
    for _ in range(changes):
        words[rng.randrange(len(words))] = rng.choice(["really", "quite", "thing", "value", "object"])
    return " ".join(words)


def _corpus() -> tuple[list[Document], list[str]]:
    """50 distinct pages of Python's reference manual, then a paraphrase of each of the first 10."""
    texts = [t for _, t in sorted(topics.items()) if len(t.split()) > 150][:50]
    rng = random.Random(0)
    docs = [Document(f"orig-{i:02d}", t, "docs", {"lang": "en"}) for i, t in enumerate(texts)]
    docs += [Document(f"para-{i:02d}", paraphrase(t, rng), "docs", {"lang": "en"}) for i, t in enumerate(texts[:10])]
    return docs, [f"orig-{i:02d}" for i in range(10)]


def _read(out: Path) -> tuple[list[Document], list[Document]]:
    return ([d for p in shard_paths(out) for d in read_shard(p)],
            [d for p in rejected_paths(out) for d in read_shard(p)])


def test_semantic_step_removes_paraphrases_minhash_keeps(tmp_path: Path) -> None:
    docs, sources = _corpus()
    stats, dedup_out = run_stage("dedup", DedupConfig(), docs, tmp_path / "dedup")
    kept_by_dedup, _ = _read(dedup_out)
    assert {d.id for d in kept_by_dedup} >= {f"para-{i:02d}" for i in range(10)}  # MinHash misses them all
    stats, out = run_stage("diversity", DiversityConfig(enabled=True, clusters=6), kept_by_dedup,
                           tmp_path / "div", shards=1)  # one shard: the order dedup left
    kept, rejected = _read(out)
    assert sorted(d.id for d in rejected) == [f"para-{i:02d}" for i in range(10)]
    for d in rejected:  # the earliest document is kept; the reason and the scores stay with the removed one
        assert d.metadata["reject_reason"] == "semantic_duplicate" and d.metadata["rejected_by"] == "diversity"
        assert d.metadata["duplicate_of"] == d.id.replace("para", "orig")
        assert d.metadata["scores"]["diversity"]["max_similarity"] >= 0.9
    assert all(d.metadata["scores"]["diversity"]["max_similarity"] < 0.9 for d in kept)
    assert stats["docs_in"] == 60 == stats["docs_kept"] + sum(stats["rejected"].values())
    assert stats["rejected_semantic_duplicate"] == 10 and {d.id for d in kept} >= set(sources)
    report = json.loads((out / "clusters.json").read_text())
    assert sum(r["docs"] for r in report["clusters"]) == 60 and all(r["top_terms"] for r in report["clusters"])
    assert (out / "clusters.png").read_bytes()[:4] == b"\x89PNG"


def test_cluster_cap_holds(tmp_path: Path) -> None:
    """One topic floods the corpus: capped, no cluster holds more than the share of what is kept."""
    flood = [Document(f"flood-{i:03d}", t, "web", {"lang": "en"}) for i, t in enumerate(documents("en", 120, seed=7))]
    docs = _corpus()[0][:50] + flood
    share = 0.3
    cfg = DiversityConfig(enabled=True, clusters=4, threshold=None, max_cluster_share=share)
    stats, out = run_stage("diversity", cfg, docs, tmp_path)
    kept, rejected = _read(out)
    clusters = [d.metadata["scores"]["diversity"]["cluster"] for d in kept]
    assert max(clusters.count(c) for c in set(clusters)) <= share * len(kept)
    assert stats["rejected"] == {"cluster_cap": len(rejected)} and len(rejected) > 0
    assert all(d.id.startswith("flood-") for d in rejected)
    assert stats["docs_in"] == len(docs) == len(kept) + len(rejected)


def test_cap_is_the_largest_that_holds() -> None:
    assert cluster_cap([100, 10, 10], 0.5) == 20  # 20 <= 0.5 * (20 + 10 + 10)
    assert cluster_cap([5, 5], 0.5) == 5
    assert cluster_cap([100], 0.5) == 0  # one cluster can never hold half


def test_an_encoder_checkpoint_by_path_replaces_the_tfidf_vectors(tmp_path: Path) -> None:
    """The wiring of ``diversity.encoder``: a real ``from_pretrained`` encoder (the tiny BERT the NER tests
    train) embeds the documents; copies that differ only in spacing embed identically and are removed,
    distinct pages are kept. (A randomly-initialised tiny encoder says nothing about paraphrases: that
    takes a real sentence-embedding model, which the tests cannot download.)"""
    from tests.fixtures.tiny_ner import make_tiny_ner

    encoder = make_tiny_ner(tmp_path / "encoder", steps=30)
    texts = [t for _, t in sorted(topics.items()) if len(t.split()) > 150][:30]
    docs = [Document(f"orig-{i:02d}", t, "docs", {"lang": "en"}) for i, t in enumerate(texts)]
    docs += [Document(f"copy-{i:02d}", "  ".join(t.split()), "docs", {"lang": "en"}) for i, t in enumerate(texts[:5])]
    cfg = DiversityConfig(enabled=True, clusters=4, threshold=0.99999, encoder=str(encoder))
    stats, out = run_stage("diversity", cfg, docs, tmp_path / "div", shards=1)
    kept, rejected = _read(out)
    assert sorted(d.id for d in rejected) == [f"copy-{i:02d}" for i in range(5)]
    assert {d.id for d in kept} == {f"orig-{i:02d}" for i in range(30)}
    assert stats["docs_in"] == 35 == stats["docs_kept"] + sum(stats["rejected"].values())
    assert stats["vectors"] == "encoder"
    # the encoder's geometry, not TF-IDF's (where distinct pages stay under 0.9, see above); the first
    # document of each cluster has no earlier one (0.0)
    sims = sorted(d.metadata["scores"]["diversity"]["max_similarity"] for d in kept)
    assert sims[len(sims) // 2] > 0.9, sims


def _topic_docs(n: int, seed: int = 0) -> list[Document]:
    """n documents of 60 words, each mostly from one of 40 topics' 50 words (a 4,000-word vocabulary)."""
    rng = random.Random(seed)
    vocab = [f"w{i}x{rng.randrange(10**6)}" for i in range(4000)]
    topics = [rng.sample(vocab, 50) for _ in range(40)]
    docs = []
    for i in range(n):
        topic = topics[rng.randrange(len(topics))]
        words = [rng.choice(topic) if rng.random() < 0.7 else rng.choice(vocab) for _ in range(60)]
        docs.append(Document(f"d{i}", " ".join(words) + ".", "web", {"lang": "en"}))
    return docs


def test_the_parent_holds_no_tfidf_row_per_document(tmp_path: Path) -> None:
    """The parent streams the TF-IDF rows a shard at a time (the sketch into a file, k-means in fixed
    blocks of it, each cluster's rows grouped on disk and loaded one cluster at a time) and builds no
    decision per document: twice the documents (in shards and clusters of the same size) leave its
    peak traced memory where it was (11.0 MiB both: the per-document arrays of a few bytes, label,
    similarity, duplicate, reason, stay under the fixed cost of 2^18 features). Holding every row,
    sketch and decision, as it did, grew the peak 11.3 -> 16.7 MiB (~3.4 KB a document)."""
    import tracemalloc

    from tests.fixtures.quality_corpus import write_upstream

    peaks = {}
    for shards in (4, 8):
        docs = _topic_docs(400 * shards, seed=shards)
        root = tmp_path / str(shards)
        write_upstream(docs, root, shards)
        cfg = DiversityConfig(enabled=True, clusters=2 * shards, threshold=0.8, sketch_dims=8)  # a k-means block < 256 KiB
        run_stage("diversity", cfg, docs[:50], tmp_path / "warm", shards=1)  # imports and caches, untraced
        tracemalloc.start()
        try:
            stats, _ = run_stage("diversity", cfg, docs, root, shards=shards, upstream_written=True)
            peaks[shards] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert stats["docs_in"] == len(docs)
    growth = peaks[8] - peaks[4]
    print(f"peak traced memory {peaks[4] / 2**20:.2f} -> {peaks[8] / 2**20:.2f} MiB for 1,600 -> 3,200 documents")
    assert growth < 512 << 10, f"peak grew {growth / 2**20:.2f} MiB for 1,600 more documents"


def test_streamed_parts_and_blocks_give_the_stacked_results(tmp_path: Path) -> None:
    """What the stage streams (IDF from the parts, the sketch file, k-means in row blocks, rows grouped
    by cluster on disk, a large cluster a few rows at a time) equals the same steps on the stacked
    matrix, bit for bit: the decisions cannot depend on how the run is cut."""
    import numpy as np
    from scipy import sparse

    from llmpipe.document import write_shard

    docs = _topic_docs(900, seed=3)
    docs += [Document(f"c{i}", d.text.replace(".", " again."), "web", {}) for i, d in enumerate(docs[:60])]
    parts, bounds = [], [0, 200, 700, len(docs)]
    for k in range(3):  # parts of unequal sizes
        shard, out = tmp_path / f"s{k}.parquet", tmp_path / f"tf{k}"
        out.mkdir()
        write_shard(shard, docs[bounds[k]:bounds[k + 1]])
        dv.term_counts(str(shard), 1 << 14, "en", out)
        parts.append(out / dv.TF)
    idf, sizes = dv.idf_of(parts, 1 << 14)
    assert sizes == [200, 500, 260]
    x = sparse.vstack([dv.tfidf_part(p, idf) for p in parts], format="csr")
    y = dv.sketch_to_file(parts, idf, 16, 0, tmp_path / "sketch.f64")
    stacked = dv._sketch_rows(x, dv._count_sketch(1 << 14, 16, 0))
    assert np.array_equal(y.rows(0, len(y)), stacked)
    labels = dv.kmeans(y, 6, 25, 0)
    assert np.array_equal(labels, dv.kmeans(stacked, 6, 25, 0))
    dup, best = dv.near_duplicates(x, labels, 0.8)
    assert (dup >= 0).sum() >= 50  # the planted copies
    grouped = dv.ClusterRows(parts, idf, labels, tmp_path / "clusters")
    assert np.array_equal(grouped.overall, np.asarray(x.mean(axis=0)).ravel())
    dup2, best2 = np.full(len(labels), -1, np.int64), np.zeros(len(labels))
    for _, members, xm in grouped.clusters():
        assert (xm != x[members]).nnz == 0
        dv.cluster_duplicates(xm, members, 0.8, dup2, best2, block=7)  # a few rows at a time
        assert dv.distinctive(xm, grouped.overall, 8)
    assert np.array_equal(dup, dup2) and np.array_equal(best, best2)


def test_compare_groups_partition_a_large_cluster_into_bounded_groups() -> None:
    """Every row in exactly one group, none over the bound, indexes ascending, the same groups from the
    same rows and seed; rows k-means cannot tell apart are cut into corpus-order runs."""
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.normal(size=(1000, 16))
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    groups = dv.compare_groups(y, 100, 25, 0)
    assert sorted(np.concatenate(groups).tolist()) == list(range(1000))
    assert all(0 < len(g) <= 100 and np.all(np.diff(g) > 0) for g in groups)
    assert sum(len(g) ** 2 for g in groups) <= 1000 * 100  # the duplicate step's cosines: n x bound at most
    assert all(np.array_equal(a, b) for a, b in zip(groups, dv.compare_groups(y, 100, 25, 0), strict=True))
    same = np.tile(y[:1], (350, 1))
    assert [g.tolist() for g in dv.compare_groups(same, 100, 25, 0)] == [
        list(range(a, min(a + 100, 350))) for a in (0, 100, 200, 300)]


def test_a_cluster_over_max_compared_finds_its_copies_in_bounded_groups(tmp_path: Path) -> None:
    """One cluster of 960 documents (60 planted copies) compared in groups of at most 200: the copies are
    still found; with a bound over the cluster's size the result is the unbounded one. 10,000 identical
    pages (the 10^5-of-the-same case) cost 10,000 x 500 cosines, not 10,000^2 / 2: one kept per run."""
    import numpy as np
    from scipy import sparse

    from llmpipe.document import write_shard

    docs = _topic_docs(900, seed=3)
    docs += [Document(f"c{i}", d.text.replace(".", " again."), "web", {}) for i, d in enumerate(docs[:60])]
    shard, out = tmp_path / "s.parquet", tmp_path / "tf"
    out.mkdir()
    write_shard(shard, docs)
    dv.term_counts(str(shard), 1 << 14, "en", out)
    idf, _ = dv.idf_of([out / dv.TF], 1 << 14)
    x = dv.tfidf_part(out / dv.TF, idf)
    one = np.zeros(x.shape[0], np.int64)
    full_dup, full_best = dv.near_duplicates(x, one, 0.8)
    dup, best = dv.near_duplicates(x, one, 0.8, max_compared=200)
    assert (full_dup[900:] >= 0).all() and (dup[900:] >= 0).all()  # every planted copy, bounded or not
    assert np.array_equal(dup[900:], full_dup[900:])
    assert all(np.array_equal(a, b) for a, b in zip((full_dup, full_best),
                                                    dv.near_duplicates(x, one, 0.8, max_compared=960), strict=True))
    row, n = x[:1], 10_000
    same = sparse.csr_matrix((np.tile(row.data, n), np.tile(row.indices, n), np.arange(n + 1) * row.nnz),
                             shape=(n, x.shape[1]))
    t0 = time.process_time()
    dup, _ = dv.near_duplicates(same, np.zeros(n, np.int64), 0.8, max_compared=500)
    print(f"10,000 identical rows in groups of 500: {time.process_time() - t0:.2f} CPU s")
    assert (dup < 0).sum() == 20 and set(dup[dup >= 0] // 500 * 500) <= set(np.flatnonzero(dup < 0))
