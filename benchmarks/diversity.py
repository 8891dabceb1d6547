"""Diversity stage docs/s and peak memory at 25k, 50k and 100k documents (hashed TF-IDF, k-means).

Each size runs in a fresh process (so its peak resident memory is its own): synthetic documents of
100-300 words from a 20,000-word vocabulary in 200 topics (each topic favours its own 300 words), a
tenth of them paraphrase-like copies of another (sentences reordered, three words changed), through
the real stage with the default settings (2^18 features, 256 sketch dimensions, 16 clusters, cosine
0.9). Printed: docs/s (wall and CPU), peak RSS, the semantic duplicates found, and how docs/s and
memory grow from the smallest to the largest size (linear growth keeps docs/s flat, memory x4).

    python benchmarks/diversity.py [--sizes 25000 50000 100000] [--workers 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from benchmarks._common import result  # noqa: E402


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))) for _ in range(20_000)]
    topics = [rng.sample(vocab, 300) for _ in range(200)]
    docs: list[str] = []
    for i in range(n):
        if i and rng.random() < 0.1:  # a paraphrase of an earlier document
            sents = docs[rng.randrange(len(docs))].split(". ")
            rng.shuffle(sents)
            words = ". ".join(sents).split(" ")
            for _ in range(3):
                words[rng.randrange(len(words))] = rng.choice(vocab)
            docs.append(" ".join(words))
            continue
        topic = topics[rng.randrange(len(topics))]
        words = [rng.choice(topic) if rng.random() < 0.7 else rng.choice(vocab) for _ in range(rng.randint(100, 300))]
        docs.append(". ".join(" ".join(words[j:j + 12]) for j in range(0, len(words), 12)))
    return docs


def one(n: int, workers: int) -> dict[str, float]:
    """Run the stage on n documents in this process; its figures."""
    from llmpipe.curation.dimensions_config import DiversityConfig
    from llmpipe.document import Document
    from llmpipe.executor import LocalExecutor
    from tests.fixtures.quality_corpus import run_stage

    docs = [Document(f"d{i}", t, "bench", {"lang": "en"}) for i, t in enumerate(corpus(n))]
    root = Path(tempfile.mkdtemp(prefix="llmpipe-bench-diversity-"))
    run_stage("diversity", DiversityConfig(enabled=True), docs[:200], root / "warm")  # imports outside the timing
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    stats, _ = run_stage("diversity", DiversityConfig(enabled=True), docs, root / "run", shards=max(2, n // 20_000),
                         executor=LocalExecutor(workers))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shutil.rmtree(root, ignore_errors=True)  # the run's shards and artifacts (GBs at the larger sizes)
    return {"docs": n, "docs_per_s": n / wall, "cpu_docs_per_s": n / cpu, "peak_mb": peak / 1024,
            "before_mb": base / 1024, "semantic_duplicates": stats.get("rejected_semantic_duplicate", 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[25_000, 50_000, 100_000])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process of one size
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.workers = [300, 600], 1
    if a.one:
        print(json.dumps(one(a.one, a.workers)))
        return
    rows = []
    for n in a.sizes:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--workers", str(a.workers)],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        rows.append(r)
        print(f"{n:>7} docs: {r['docs_per_s']:,.0f} docs/s wall, {r['cpu_docs_per_s']:,.0f} docs/s CPU (parent), "
              f"peak RSS {r['peak_mb']:,.0f} MB (before the run {r['before_mb']:,.0f} MB), "
              f"{r['semantic_duplicates']} semantic duplicates")
    first, last = rows[0], rows[-1]
    growth = last["peak_mb"] / first["peak_mb"]
    print(f"{first['docs']} -> {last['docs']} docs: docs/s x{last['docs_per_s'] / first['docs_per_s']:.2f}, "
          f"peak memory x{growth:.2f} (documents x{last['docs'] / first['docs']:.0f})")
    result("diversity_memory_growth", growth, "<=", last["docs"] / first["docs"])


if __name__ == "__main__":
    main()
