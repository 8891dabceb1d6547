"""Peak memory of in-memory (datasketch MinHashLSH) vs out-of-core (disk band buckets) dedup.

Each (size, backend) runs the real ``dedup`` stage in a fresh subprocess on the same generated
corpus (10% planted near-duplicates, 2% exact copies) and reports its ``ru_maxrss``; the baseline
(the same subprocess after imports, before the stage) is printed too, so the growth of the stage
itself is visible. Both backends must produce the same kept count. Each line also gives the
stage's per-phase driver CPU seconds and its reads (exact-index runs, verification and keeper-id
shard reads): with small shards (``--shard-docs 1000``) a cost growing with shards x corpus shows
as a ratio between two sizes well above theirs, readable on a machine shared with other jobs.

    python benchmarks/dedup_memory.py [--sizes 20000,80000,320000] [--budget-mb 16] [--shard-docs 5000]
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

SHARD_DOCS = 5000


def make_corpus(root: Path, n: int, seed: int = 0, shard_docs: int = SHARD_DOCS) -> Path:
    """Shards of ~60-word docs; every 10th doc is a near copy of an earlier one, every 50th exact."""
    from llmpipe.document import Document, write_shard

    rng = random.Random(seed)
    docs: list[Document] = []
    texts: list[str] = []
    shard = 0
    for i in range(n):
        if i > 100 and i % 50 == 0:
            text = texts[rng.randrange(len(texts))]
        elif i > 100 and i % 10 == 0:
            w = texts[rng.randrange(len(texts))].split(" ")
            w[rng.randrange(len(w))] = f"e{i}"
            text = " ".join(w)
        else:
            text = " ".join(f"w{rng.randrange(100_000)}" for _ in range(60))
        texts.append(text)
        docs.append(Document(f"d{i}", text, "bench", {}))
        if len(docs) == shard_docs:
            write_shard(root / "shards" / f"part-{shard:05d}.parquet", docs)
            docs, shard = [], shard + 1
    if docs:
        write_shard(root / "shards" / f"part-{shard:05d}.parquet", docs)
    return root


def child(corpus: str, backend: str, budget: float, store: str) -> None:
    """Run the dedup stage once and print JSON with peak RSS (MiB)."""
    import llmpipe.curation.dedup.stage  # noqa: F401
    from llmpipe.curation.config import DedupConfig
    from llmpipe.curation.dedup.minhash import signatures
    from llmpipe.executor import LocalExecutor
    from llmpipe.stage import STAGES, StageContext
    from llmpipe.store import ArtifactStore

    signatures(["warm up the kernel"])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cfg = DedupConfig(backend=backend, memory_budget_mb=budget, incremental=False)
    st = ArtifactStore(store)
    out = Path(store) / "out"
    out.mkdir()
    src = STAGES["dedup"].inputs[0]  # the stage's one input (its upstream stage's name)
    ctx = StageContext(spec=STAGES["dedup"], config=cfg, pipeline=None, key=f"bench-{backend}", out=out,
                       inputs={src: Path(corpus)}, input_keys={src: "x"}, store=st, executor=LocalExecutor(1))
    t = time.perf_counter()
    stats = STAGES["dedup"].fn(ctx)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reads = {k: stats.get(k) for k in ("exact_run_reads", "verify_shard_reads", "id_shard_reads")}
    print(json.dumps({"base_mb": base, "peak_mb": peak, "seconds": time.perf_counter() - t, "kept": stats["kept"],
                      "cpu": stats.get("cpu_seconds", {}), "reads": reads, "edges": stats["edges_candidate"]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="20000,80000,320000")
    ap.add_argument("--budget-mb", type=float, default=16)
    ap.add_argument("--shard-docs", type=int, default=SHARD_DOCS, help="documents per input shard")
    ap.add_argument("--backends", default="memory,external", help="LSH backends to run, comma-separated")
    ap.add_argument("--child", nargs=4)
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.budget_mb = "1000,2000", 1
    if a.child:
        child(a.child[0], a.child[1], float(a.child[2]), a.child[3])
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    res: dict[str, list[dict]] = {b: [] for b in a.backends.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            corpus = make_corpus(Path(tmp) / f"c{n}", n, shard_docs=a.shard_docs)
            for backend in res:
                store = Path(tmp) / f"s{n}-{backend}"
                out = subprocess.run([sys.executable, __file__, "--child", str(corpus), backend, str(a.budget_mb),
                                      str(store)], capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                res[backend].append(r)
                print(f"n={n:>7} {backend:8s} peak {r['peak_mb']:7.1f} MiB (baseline {r['base_mb']:6.1f}, "
                      f"stage +{r['peak_mb'] - r['base_mb']:6.1f}) {r['seconds']:6.1f}s kept={r['kept']}", flush=True)
                phases = " ".join(f"{k} {v:.2f}" for k, v in r["cpu"].items() if k != "load_previous")
                print(f"           driver CPU s: {phases}; edges {r['edges']}; reads {r['reads']}", flush=True)
            assert len({r[-1]["kept"] for r in res.values()}) == 1, "backends disagree"
    growth = {b: res[b][-1]["peak_mb"] / res[b][0]["peak_mb"] for b in res}
    stage_growth = {b: (res[b][-1]["peak_mb"] - res[b][-1]["base_mb"]) / max(1e-9, res[b][0]["peak_mb"] - res[b][0]["base_mb"])
                    for b in res}
    for b in res:
        cpu = {k: res[b][-1]["cpu"].get(k, 0) / max(1e-9, res[b][0]["cpu"].get(k, 0)) for k in res[b][-1]["cpu"]}
        print(f"{b}: {sizes[0]} -> {sizes[-1]} docs ({sizes[-1] / sizes[0]:.1f}x): peak {growth[b]:.2f}x "
              f"(stage-only {stage_growth[b]:.2f}x); driver CPU " + ", ".join(
                  f"{k} {v:.2f}x" for k, v in cpu.items() if k != "load_previous"))
    if "memory" in res and "external" in res:
        print(f"out-of-core peak / in-memory peak at {sizes[-1]}: "
              f"{res['external'][-1]['peak_mb'] / res['memory'][-1]['peak_mb']:.2f}")
    print(f"RESULT out_of_core_peak_growth {growth.get('external', float('nan')):.2f} goal <= 1.5")


if __name__ == "__main__":
    main()
