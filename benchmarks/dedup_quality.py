"""Near-dedup against the exact Jaccard on real text with planted near-copies; the cost of one boilerplate cluster.

1. Precision and recall. The documents are real text: Python's own documentation (``pydoc_data``
   topics) and the standard library's docstrings, cut as the built-in corpus cuts them
   (:mod:`llmpipe.data.builtin_corpus`, ~1,800 characters each). Each original gets one near-copy
   with ``k`` words replaced, ``k`` drawn so that the copies' Jaccard spreads over 0.65-1.0
   (most of them within 0.1 of the threshold); the copies come after every original, so the
   original is the earlier document. Truth is the exact Jaccard of the two documents' 5-word
   shingle sets, computed here from the texts. The real ``dedup`` stage (default config) runs on
   them; then
   - precision: of the documents it removed as near duplicates, the share whose exact Jaccard with
     the document it names in ``duplicate_of`` (a kept one) is >= the threshold;
   - recall: of the planted pairs with exact Jaccard >= the threshold, the share whose copy it removed.
   Baseline, on the same signatures and LSH bands: datasketch ``MinHashLSH`` with every bucket
   member a candidate, verified by the signatures' estimated Jaccard, each document removed for its
   earliest verified candidate's keeper (the rule this stage had before the exact verification).
2. Cost of a boilerplate cluster: ``n`` templated pages (the same 300 words of real text, the last
   one different: every pair's Jaccard is ~0.99, so every page lands in the same buckets) through the
   stage, each size in a fresh process: candidate edges (counted by the stage), CPU seconds and peak
   resident memory. All-pairs candidates would be n(n-1)/2; the stage makes at most one edge per page
   and band. Time and memory should grow linearly: the figure printed is CPU seconds per page at
   the largest size ÷ at the smallest.

The last line is the stage's precision: ``RESULT dedup_precision <value> goal >= 0.99``.

    .venv/bin/python benchmarks/dedup_quality.py [--cluster-sizes 25000,100000]
"""

from __future__ import annotations

import sys
from pathlib import Path

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

SHARD_DOCS = 5000


def real_texts() -> list[str]:
    from llmpipe.data.builtin_corpus import pydoc_documents, stdlib_documents

    return [d["text"] for d in pydoc_documents() + stdlib_documents() if len(d["text"].split()) >= 60]


def near_copy(rng: random.Random, text: str, target: float) -> str:
    """``text`` with words replaced, >= 5 apart, so that its 5-shingle Jaccard is about ``target``."""
    words = text.split()
    s = max(1, len(words) - 4)
    k = max(0, round(s * (1 - target) / (5 * (1 + target))))
    slots = list(range(2, len(words) - 2, 5))
    for pos in rng.sample(slots, min(k, len(slots))):
        words[pos] = f"x{rng.randrange(10**9)}"
    return " ".join(words)


def jaccard(a: set[bytes], b: set[bytes]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def write_shards(root: Path, texts: list[str]) -> Path:
    from llmpipe.document import Document, write_shard

    for s in range(0, len(texts), SHARD_DOCS):
        docs = [Document(f"d{i}", texts[i], "bench", {}) for i in range(s, min(len(texts), s + SHARD_DOCS))]
        write_shard(root / "shards" / f"part-{s // SHARD_DOCS:05d}.parquet", docs)
    return root


def run_stage(inp: Path, work: Path, cfg: Any) -> tuple[Path, dict[str, Any]]:
    """The registered dedup stage, called as the DAG calls it (one in-process shard worker)."""
    import llmpipe.curation.dedup.stage  # noqa: F401  (registers the stage)
    from llmpipe.executor import LocalExecutor
    from llmpipe.stage import STAGES, StageContext
    from llmpipe.store import ArtifactStore

    spec = STAGES["dedup"]
    out = work / "out"
    out.mkdir(parents=True)
    ctx = StageContext(spec=spec, config=cfg, pipeline=None, key="bench", out=out, inputs={spec.inputs[0]: inp},
                       input_keys={spec.inputs[0]: "bench"}, store=ArtifactStore(work / "store"),
                       executor=LocalExecutor(1))
    return out, spec.fn(ctx)


def removed(out: Path) -> dict[str, tuple[str, str]]:
    """id -> (reason, duplicate_of) of the documents the stage removed."""
    from llmpipe.document import iter_documents

    return {d.id: (d.metadata["reject_reason"], d.metadata["duplicate_of"])
            for p in sorted((out / "rejected").glob("*.parquet")) for d in iter_documents(p)}


def baseline(texts: list[str], cfg: Any) -> dict[str, tuple[str, str]]:
    """datasketch MinHashLSH, all bucket members as candidates, verified by estimated Jaccard."""
    from datasketch import MinHashLSH

    from llmpipe.curation.dedup import datasketch_adapter as ds
    from llmpipe.curation.dedup.lsh import lsh_params
    from llmpipe.curation.dedup.minhash import signatures

    sigs = signatures(texts, num_perm=cfg.num_perm, seed=cfg.seed)
    params = lsh_params(cfg.threshold, cfg.num_perm, cfg.bands, cfg.rows, cfg.false_positive_weight,
                        cfg.false_negative_weight)
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, params=params)
    keeper = list(range(len(texts)))
    out = {}
    for j, row in enumerate(sigs):
        m = ds.lean(row, cfg.seed)
        near = [i for i in lsh.query(m) if (sigs[i] == row).mean() >= cfg.threshold]
        lsh.insert(j, m, check_duplication=False)
        if near:
            keeper[j] = keeper[min(near)]
            out[f"d{j}"] = ("near_duplicate", f"d{keeper[j]}")
    return out


def quality(pairs: int, seed: int = 0) -> float:
    from llmpipe.curation.config import DedupConfig
    from llmpipe.curation.dedup.text import shingles

    rng = random.Random(seed)
    originals = real_texts()[:pairs]
    targets = [rng.choice((rng.uniform(0.65, 1.0), rng.uniform(0.72, 0.9))) for _ in originals]
    copies = [near_copy(rng, t, x) for t, x in zip(originals, targets, strict=True)]
    texts = originals + copies
    sets = [set(shingles(t)) for t in texts]
    n = len(originals)
    truth = [jaccard(sets[i], sets[n + i]) for i in range(n)]
    cfg = DedupConfig()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.process_time()
        out, stats = run_stage(write_shards(Path(tmp) / "in", texts), Path(tmp) / "work", cfg)
        secs = time.process_time() - t0
        ours = removed(out)
    theirs = baseline(texts, cfg)
    high = [i for i in range(n) if truth[i] >= cfg.threshold]
    near_band = sum(abs(x - cfg.threshold) <= 0.1 for x in truth)
    print(f"{len(texts)} documents of real text: {n} originals, {n} planted near-copies (exact Jaccard "
          f"{min(truth):.2f}-{max(truth):.2f}, {near_band} within 0.1 of {cfg.threshold}, {len(high)} >= it)")
    figures = {}
    for side, dec in (("llmpipe (exact verification)", ours), ("datasketch, estimated Jaccard", theirs)):
        near = [(int(d[1:]), int(k[1:])) for d, (r, k) in dec.items() if r == "near_duplicate"]
        right = sum(jaccard(sets[d], sets[k]) >= cfg.threshold for d, k in near)
        found = sum(f"d{n + i}" in dec for i in high)
        precision, recall = right / max(1, len(near)), found / max(1, len(high))
        figures[side] = precision, recall
        print(f"  {side:30s} removed {len(near):4d} near duplicates: precision {precision:.4f} "
              f"({len(near) - right} below the threshold), recall {recall:.4f} ({found}/{len(high)})")
    print(f"  stage: {stats['edges_candidate']} candidate edges, {stats['edges_verified']} exact Jaccards, "
          f"{secs:.1f} CPU s")
    precision, recall = figures["llmpipe (exact verification)"]
    print(f"RESULT dedup_recall {recall:.4f} goal >= 0.97")
    return precision


def cluster_child(n: int, backend: str) -> None:
    """One boilerplate cluster through the stage; prints JSON (edges, CPU s, peak RSS MiB)."""
    from llmpipe.curation.config import DedupConfig
    from llmpipe.curation.dedup.minhash import signatures

    words = " ".join(real_texts()).split()[:299]
    signatures(["warm up the kernel"])
    with tempfile.TemporaryDirectory() as tmp:
        inp = write_shards(Path(tmp) / "in", [" ".join([*words, f"page{i}"]) for i in range(n)])
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.process_time()
        _out, stats = run_stage(inp, Path(tmp) / "work", DedupConfig(backend=backend, incremental=False))
        secs = time.process_time() - t0
    print(json.dumps({"edges": stats["edges_candidate"], "kept": stats["kept"], "cpu": secs, "base_mb": base,
                      "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def cluster_cost(sizes: list[int], backend: str) -> None:
    rows = []
    for n in sizes:
        out = subprocess.run([sys.executable, __file__, "--child", str(n), backend], capture_output=True, text=True,
                             check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append(r)
        print(f"  cluster of {n:>7} pages ({backend}): {r['edges']:>7} candidate edges (all pairs: {n * (n - 1) // 2:,}), "
              f"kept {r['kept']}, {r['cpu']:6.1f} CPU s ({1e3 * r['cpu'] / n:.2f} ms/page), peak RSS "
              f"{r['peak_mb']:6.0f} MiB (stage +{r['peak_mb'] - r['base_mb']:.0f})", flush=True)
        assert r["kept"] == 1, "every templated page but the first is a near duplicate"
    a, b = rows[0], rows[-1]
    print(f"  {sizes[0]} -> {sizes[-1]} pages (x{sizes[-1] / sizes[0]:.0f}): edges x{b['edges'] / max(1, a['edges']):.1f}, "
          f"CPU s per page x{(b['cpu'] / sizes[-1]) / (a['cpu'] / sizes[0]):.2f}, stage memory "
          f"x{(b['peak_mb'] - b['base_mb']) / max(1.0, a['peak_mb'] - a['base_mb']):.2f}")
    print(f"RESULT dedup_cluster_cpu_per_page_growth {(b['cpu'] / sizes[-1]) / (a['cpu'] / sizes[0]):.2f} goal <= 1.5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=1000, help="planted pairs (at most one per real document)")
    ap.add_argument("--cluster-sizes", default="25000,100000", help="pages of the boilerplate cluster runs")
    ap.add_argument("--backend", default="memory", choices=("memory", "external"), help="for the cluster runs")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    a = ap.parse_args()
    if a.quick:
        a.pairs, a.cluster_sizes = 150, "200,800"
    if a.child:
        cluster_child(int(a.child[0]), a.child[1])
        return
    print("boilerplate cluster:")
    cluster_cost([int(s) for s in a.cluster_sizes.split(",")], a.backend)
    print("planted pairs:")
    precision = quality(a.pairs)
    print(f"RESULT dedup_precision {precision:.4f} goal >= 0.99")


if __name__ == "__main__":
    main()
