"""Does the default run teach the model something? Held-out bpb of the tiny model ÷ a unigram model's (issue 15).

A cold tiny lifecycle (configs/tiny.yaml, the built-in corpus) on a fresh temporary store, run with
the library DAG (``llmpipe.dag.run_pipeline``) one stage at a time so that each stage's wall
time and CPU time (this process and its children: the shard pools, the torchrun workers) are
measured; the machine may be shared, so CPU time is the steadier figure. The evaluate stage scores
the model and a unigram model of the train split's tokens (add-one smoothing) on the same held-out
bytes; the baseline of the ratio is that unigram model, and the goal is <= 0.8.

``--steps 100 200 400`` adds the curve: the same store, pretrain -> evaluate again at each
``train.max_steps`` (the cosine schedule spans the run, so each is its own run), ratio against the
pretrain stage's time.

    .venv/bin/python benchmarks/tiny_vs_unigram.py [--repeat 2] [--steps 100 200 400] [overrides ...]
"""

from __future__ import annotations

import os
import sys

# benchmarks/tokenize.py would shadow the stdlib module: drop this folder from the import path first
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import result  # noqa: E402


def cpu_seconds() -> float:
    """User + system CPU of this process and of every child it (or they) waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_stages(cfg: Any, stages: list[str]) -> list[tuple[str, float, float, Any]]:
    """(stage, wall s, CPU s, run) of each stage, run one at a time on the config's store."""
    from llmpipe.dag import run_pipeline

    rows = []
    for name in stages:
        t0, c0 = time.perf_counter(), cpu_seconds()
        (run,) = run_pipeline(cfg, None, name, name)
        rows.append((name, time.perf_counter() - t0, cpu_seconds() - c0, run))
    return rows


def quality(evaluate_dir: str) -> dict[str, Any]:
    res = json.loads((Path(evaluate_dir) / "results.json").read_text())
    base = res["baseline"]
    return {"bpb": res["metrics"]["overall"]["bits_per_byte"], "unigram": base["overall"]["bits_per_byte"],
            "ratio": base["bits_per_byte_ratio"], "train_tokens": base["train_tokens"],
            "per_language": base["per_language_bits_per_byte_ratio"],
            "kn": (res.get("kn_baseline") or {}).get("overall", {}).get("bits_per_byte"),
            "kn_smoothing": (res.get("kn_baseline") or {}).get("smoothing"),
            "document_bpb": (res["metrics"].get("documents") or {}).get("bits_per_byte"),
            "samples": res["metrics"].get("generations", [])}


def config(tmp: Path, overrides: list[str]) -> Any:
    from llmpipe.config import load_config

    return load_config(ROOT / "configs" / "tiny.yaml",
                       [f"store={tmp / 'store'}", f"state_dir={tmp / 'state'}", *overrides])


def cold_run(overrides: list[str], until: str | None = None) -> tuple[dict[str, Any], Path]:
    """One cold lifecycle in a new temporary folder (up to stage ``until``): prints per-stage times, returns
    the model's quality."""
    from llmpipe.dag import plan

    tmp = Path(tempfile.mkdtemp(prefix="llmpipe-tiny-vs-unigram-"))
    cfg = config(tmp, overrides)
    stages = list(plan(cfg))
    rows = run_stages(cfg, stages[: stages.index(until) + 1] if until else stages)
    print(f"{'stage':10s} {'wall s':>8s} {'CPU s':>8s}")
    for name, wall, cpu, _ in rows:
        print(f"{name:10s} {wall:8.2f} {cpu:8.2f}")
    wall, cpu = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"{'total':10s} {wall:8.2f} {cpu:8.2f}   (cold tiny lifecycle, {os.cpu_count()} CPUs visible)")
    q = quality(next(r[3].path for r in rows if r[0] == "evaluate"))
    pre = next(r[3] for r in rows if r[0] == "pretrain")
    print(f"pretrain: {pre.stats.get('steps')} steps, {pre.stats.get('tokens')} tokens; "
          f"unigram fitted on {q['train_tokens']} train tokens")
    print(f"beside: {q['kn_smoothing']}: {q['kn']} bpb on the same bytes; whole documents: {q['document_bpb']} bpb")
    return q, tmp


def curve(tmp: Path, overrides: list[str], steps: list[int]) -> None:
    """Ratio against pretrain time at several ``train.max_steps`` on the cold run's store."""
    print(f"\n{'max_steps':>9s} {'pretrain wall s':>16s} {'pretrain CPU s':>15s} {'bpb':>7s} {'unigram':>8s} "
          f"{'ratio':>7s}")
    for n in steps:
        cfg = config(tmp, [*overrides, f"train.max_steps={n}"])
        rows = run_stages(cfg, ["pretrain", "evaluate"])
        q = quality(rows[1][3].path)
        print(f"{n:9d} {rows[0][1]:16.2f} {rows[0][2]:15.2f} {q['bpb']:7.3f} {q['unigram']:8.3f} {q['ratio']:7.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=1, help="cold runs (each in a new store); times of each")
    ap.add_argument("--steps", type=int, nargs="*", default=[], help="train.max_steps values for the curve")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_steps=200")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        # up to evaluate, without the harness tasks (not in this script's figures; the harness has tests
        # and a benchmark of its own) and on fewer sequences: the quick run only has to reach its RESULT line
        args.overrides = ["train.max_steps=10", "ingest.sample=0.1", "evaluate.harness.tasks=[]",
                          "evaluate.max_sequences=16", "evaluate.documents=4", *args.overrides]

    tmps: list[Path] = []
    try:
        ratios = []
        for i in range(args.repeat):
            print(f"\ncold run {i + 1} of {args.repeat}")
            q, tmp = cold_run(args.overrides, "evaluate" if args.quick else None)
            tmps.append(tmp)
            ratios.append(q["ratio"])
            print(f"held-out bits per byte: model {q['bpb']:.4f}, unigram {q['unigram']:.4f}, "
                  f"ratio {q['ratio']:.4f}")
        print("per language (model ÷ unigram):", {k: round(v, 3) for k, v in q["per_language"].items() if v})
        for s in q["samples"]:
            print(f"greedy {s['prompt']!r} -> {s['completion']!r}")
        if len(set(ratios)) > 1:
            print(f"note: the cold runs gave different ratios {ratios}")
        if args.steps:
            curve(tmps[-1], args.overrides, args.steps)
        result("tiny_bpb_vs_unigram", ratios[-1], "<=", 0.8)
    finally:
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)


if __name__ == "__main__":
    main()
