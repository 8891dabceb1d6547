"""Cold tiny lifecycle vs a no-change rerun vs a refresh with 1% new documents (issue 8).

The tiny preset (configs/tiny.yaml) plus one JSONL folder source runs three times into one fresh
store: cold; again with nothing changed (every stage reused); again after a new file with 1% more
documents lands in the folder (only new shards and the stages downstream of changed inputs run).
Each run is ``llmpipe.dag.run_pipeline`` in this process (imports excluded). The baseline is the
cold run; goals: rerun < 5% and refresh < 20% of it.

    .venv/bin/python benchmarks/lifecycle.py [--docs 400] [--flow lifecycle] [overrides ...]
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

ROOT = Path(__file__).resolve().parent.parent


def write_docs(path: Path, n: int, start: int, seed: int) -> None:
    """``n`` distinct English documents from Python's bundled docs (kept by the curation filters)."""
    from pydoc_data.topics import topics

    paras = [p.strip() for t in topics.values() for p in t.split("\n\n") if len(p.split()) >= 12]
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"bench-{i}", "text": "\n\n".join(rng.sample(paras, 3))}) + "\n")


def timed_run(cfg, flow: str) -> tuple[float, list]:
    from llmpipe.dag import run_pipeline

    t0 = time.perf_counter()
    runs = run_pipeline(cfg, flow)
    return time.perf_counter() - t0, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=400, help="documents in the extra JSONL source")
    ap.add_argument("--flow", default="lifecycle")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_steps=10")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.flow = 40, "data_refresh"  # curation + tokenize only, on a tenth of each source
        args.overrides = ["ingest.sample=0.1", *args.overrides]

    import yaml

    from llmpipe.config import load_config

    tmp = Path(tempfile.mkdtemp(prefix="llmpipe-lifecycle-bench-"))
    try:
        data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
        data["store"], data["state_dir"] = str(tmp / "store"), str(tmp / "state")
        data.setdefault("sources", []).append({"name": "extra", "path": str(tmp / "extra"), "format": "jsonl"})
        cfg_path = tmp / "bench.yaml"
        cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
        write_docs(tmp / "extra" / "part-000.jsonl", args.docs, 0, seed=1)

        cfg = load_config(cfg_path, args.overrides)
        cold, runs = timed_run(cfg, args.flow)
        ingested = sum(int(r.stats.get("ingested", 0)) for r in runs if r.stage == "ingest")
        print(f"cold:    {cold:8.2f}s  ({len(runs)} stages, {ingested} docs ingested)")

        rerun, runs2 = timed_run(load_config(cfg_path, args.overrides), args.flow)
        ran = [r.stage for r in runs2 if r.ran]
        print(f"rerun:   {rerun:8.2f}s  stages recomputed: {ran or 'none'}")

        new = max(1, round(ingested * 0.01))
        write_docs(tmp / "extra" / "part-001.jsonl", new, args.docs, seed=2)
        refresh, runs3 = timed_run(load_config(cfg_path, args.overrides), args.flow)
        print(f"refresh: {refresh:8.2f}s  (+{new} docs) stages recomputed: {[r.stage for r in runs3 if r.ran]}")
        for r in runs3:
            print(f"    {r.stage:10s} {'ran' if r.ran else 'cached':6s} {r.seconds:7.2f}s")

        print(f"rerun / cold   = {rerun / cold:.4f}  (goal < 0.05)")
        print(f"refresh / cold = {refresh / cold:.4f}  (goal < 0.20)")
        print(f"RESULT lifecycle_rerun_ratio {rerun / cold:.4f} goal < 0.05")
        print(f"RESULT lifecycle_refresh_ratio {refresh / cold:.4f} goal < 0.20")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
