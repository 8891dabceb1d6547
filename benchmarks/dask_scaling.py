"""Curation throughput on Dask: 1 worker process vs 2 (issue 9, goal: ratio >= 1.6), and the cost of a
separately started cluster against the local executor (issue 30).

The same corpus (English paragraphs from Python's bundled docs, shuffled into documents, split in
shards) goes through ingest -> langid -> quality -> safety -> dedup, each time into a fresh store:
with the shard jobs on a LocalCluster of 1 then 2 single-threaded workers (the RESULT ratio), then on
the local executor's 2 processes and on a separately started ``dask scheduler`` with two ``dask
worker`` processes (own folders, ``executor.dask_address``), whose docs/s ratio is printed as the
overhead of that path. Curation docs/s = ingested documents / wall seconds of the curation stages.

    .venv/bin/python benchmarks/dask_scaling.py [--docs 8000] [--shards 8] [--rounds 3]
"""

from __future__ import annotations

import os
import sys

# benchmarks/tokenize.py would shadow the stdlib module: drop this folder from the import path first
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

# langid through dedup in DAG order (the quality-dimension and entity stages between them pass through when off)
CURATION = ("langid", "quality", "coherence", "expertise", "safety", "entities", "dedup")


def make_corpus(root: Path, docs: int, shards: int, seed: int = 0) -> None:
    """``shards`` JSONL files of realistic English documents, every one distinct."""
    from pydoc_data.topics import topics

    paras = [p.strip() for t in topics.values() for p in t.split("\n\n") if len(p.split()) >= 12]
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    per = -(-docs // shards)
    n = 0
    for s in range(shards):
        with open(root / f"part-{s:03d}.jsonl", "w", encoding="utf-8") as f:
            for _ in range(min(per, docs - n)):
                text = "\n\n".join(rng.sample(paras, 4)) + f"\n\nDocument {n}."
                f.write(json.dumps({"id": f"d{n}", "text": text}) + "\n")
                n += 1


def run_once(corpus: Path, store: Path, executor_cfg: dict, docs_per_shard: int) -> tuple[int, float, dict[str, str]]:
    """(ingested docs, curation seconds, stage -> key) with shard jobs on the executor ``executor_cfg`` names."""
    from llmpipe.config import load_config
    from llmpipe.dag import execute, make_executor, open_store, plan
    from llmpipe.executor_dask import close_local_clusters

    cfg = load_config(None, data={
        "name": "dask-bench", "store": str(store), "state_dir": str(store.parent / "state"),
        "sources": [{"name": "bench", "path": str(corpus), "format": "jsonl"}],
        "ingest": {"max_docs_per_shard": docs_per_shard},
        "executor": executor_cfg,
    })
    st = open_store(cfg)
    planned = plan(cfg)
    executor = make_executor(cfg)
    if executor_cfg["kind"] == "dask":
        executor.map(abs, list(range(8)))  # start (or connect to) the cluster before timing
    arts, seconds, keys = {}, 0.0, {}
    try:
        for name in ("ingest", *CURATION):
            ps = planned[name]
            t0 = time.perf_counter()
            art, ran, _ = execute(cfg, st, ps, {d: arts[d] for d in ps.upstream}, executor=executor)
            if name in CURATION:
                seconds += time.perf_counter() - t0
            assert ran, f"{name} was cached in a fresh store"
            arts[name], keys[name] = art, ps.key
    finally:
        if hasattr(executor, "close"):
            executor.close()
        close_local_clusters()
    ingested = int(arts["ingest"].stats.get("ingested") or arts["ingest"].stats.get("docs") or 0)
    return ingested, seconds, keys


def report(label: str, result: tuple[int, float, dict[str, str]]) -> tuple[int, float, dict[str, str]]:
    docs, secs, _keys = result
    print(f"{label}: {docs} docs curated in {secs:.2f}s -> {docs / secs:.0f} docs/s", flush=True)
    return result


def main() -> None:
    from llmpipe.executor_dask import dask_processes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=8000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="local vs separately started cluster rounds (best of)")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.shards, args.rounds = 400, 2, 1
    tmp = Path(tempfile.mkdtemp(prefix="llmpipe-dask-bench-"))
    try:
        make_corpus(tmp / "corpus", args.docs, args.shards)
        per_shard = -(-args.docs // args.shards)
        results = {}
        for w in (1, 2):
            cfg = {"kind": "dask", "dask_workers": w, "dask_threads_per_worker": 1}
            results[w] = report(f"dask LocalCluster workers={w}", run_once(tmp / "corpus", tmp / f"store-{w}",
                                                                           cfg, per_shard))
        # local and separately started cluster alternate, best round each: other jobs' load moves both alike
        with dask_processes(tmp / "cluster", n_workers=2) as address:
            for r in range(args.rounds):
                for name, cfg in (("local", {"kind": "local", "workers": 2}),
                                  ("separate", {"kind": "dask", "dask_address": address})):
                    label = ("local executor workers=2" if name == "local"
                             else "dask scheduler + 2 workers started apart")
                    got = report(f"{label} (round {r + 1})", run_once(
                        tmp / "corpus", tmp / f"store-{name}-{r}", cfg, per_shard))
                    if name not in results or got[0] / got[1] > results[name][0] / results[name][1]:
                        results[name] = got
        assert len({str(r[2]) for r in results.values()}) == 1, "stage keys differ between executors"
        rate = {k: r[0] / r[1] for k, r in results.items()}
        apart = rate["separate"] / rate["local"]
        print(f"separately started cluster / local executor docs/s (best of {args.rounds} rounds each): "
              f"{apart:.3f} (overhead {1 - apart:+.1%}; goal >= 0.9 at 500k documents)")
        ratio = rate[2] / rate[1]
        print(f"2 workers / 1 worker (baseline) docs/s ratio: {ratio:.2f}")
        print(f"RESULT dask_scaling_ratio {ratio:.3f} goal >= 1.6")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
