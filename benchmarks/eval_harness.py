"""Items per second of evaluate's harness tasks against lm-evaluation-harness's own simple_evaluate.

Same model (a save_pretrained folder), same tasks (the built-in tiny_mc, tiny_cloze, tiny_docs), same
batch size, on CPU. Ours is what the evaluate stage runs: ``load_model`` + ``run_harness`` (the
TaskManager over the shipped tasks, HFLM around the loaded model, ``simple_evaluate``, the results
with their standard errors). The peer is the harness's own entry point as its users call it:
``simple_evaluate(model="hf", model_args="pretrained=<folder>")``, which loads the model itself.
Both wall times include loading the model; after one untimed warm-up on two items per task (imports,
first-call setup: costs both sides share), each side runs ``--repeat`` times, alternating, and the
best time counts (the machine may be shared). Both must give the same numbers, or the script fails.

    ratio = (items / our seconds) / (items / harness seconds)      goal >= 0.9 (no overhead of ours)

Without ``--model`` a small Llama is trained on the toy corpus first (about a minute on CPU).

    python benchmarks/eval_harness.py [--model DIR] [--repeat 3] [--batch-size 8] [--quick]
"""

from __future__ import annotations

import os
import sys

# benchmarks/tokenize.py would shadow the stdlib module: drop this folder from the import path first
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import result  # noqa: E402


def ours(model_dir: Path, tasks: list[str], batch_size: int, limit: int | None = None
         ) -> tuple[float, dict[str, Any]]:
    """(seconds, per-task metrics) of the evaluate stage's path."""
    import torch

    from llmpipe.evaluation.config import HarnessConfig
    from llmpipe.evaluation.harness import run_harness
    from llmpipe.evaluation.model_io import load_model, load_tokenizer

    t0 = time.perf_counter()
    model, tok = load_model(model_dir, torch.device("cpu")), load_tokenizer(model_dir)
    res = run_harness(model, tok, HarnessConfig(tasks=tasks, batch_size=batch_size, limit=limit))
    return time.perf_counter() - t0, {n: t["metrics"] for n, t in res["tasks"].items()}


def theirs(model_dir: Path, tasks: list[str], batch_size: int) -> tuple[float, dict[str, Any]]:
    """(seconds, per-task metrics) of the harness's own ``simple_evaluate`` on the folder."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from llmpipe.evaluation.harness import BUILTIN_TASKS

    t0 = time.perf_counter()
    tm = TaskManager(include_path=str(BUILTIN_TASKS), include_defaults=False)
    out = simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32", device="cpu",
                          batch_size=batch_size, tasks=tasks, task_manager=tm, bootstrap_iters=1000,
                          log_samples=False)
    seconds = time.perf_counter() - t0
    return seconds, {n: {k.split(",")[0]: v for k, v in row.items() if k.endswith(",none") and "_stderr" not in k}
                     for n, row in out["results"].items()}


def main() -> None:
    from llmpipe.evaluation.harness import BUILTIN_NAMES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a save_pretrained folder with its tokenizer "
                    "(default: train the toy model)")
    ap.add_argument("--tasks", nargs="+", default=list(BUILTIN_NAMES))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="one run each (the test suite's smoke run)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import datasets  # noqa: F401 - imports are one-off costs of whichever side runs first: pay them here
    import lm_eval.models.huggingface  # noqa: F401
    import transformers  # noqa: F401

    repeat = 1 if args.quick else args.repeat
    work = None
    model_dir = args.model
    if model_dir is None:
        from tests.fixtures import toy_model as toy

        work = Path(tempfile.mkdtemp(prefix="llmpipe-eval-harness-bench-"))
        model_dir = toy.build(work, hidden=128, intermediate=256, steps=150).pretrain
    try:
        ours(model_dir, args.tasks, args.batch_size, limit=2)  # untimed: first-call costs both sides share
        best = {"ours": float("inf"), "harness": float("inf")}
        numbers: dict[str, Any] = {}
        for _ in range(repeat):
            for name, fn in (("ours", ours), ("harness", theirs)):
                seconds, metrics = fn(model_dir, args.tasks, args.batch_size)
                best[name] = min(best[name], seconds)
                numbers[name] = metrics
        if numbers["ours"] != numbers["harness"]:
            raise SystemExit(f"the two paths disagree:\nours    {numbers['ours']}\nharness {numbers['harness']}")
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    from lm_eval.tasks import TaskManager

    from llmpipe.evaluation.harness import BUILTIN_TASKS

    tm = TaskManager(include_path=str(BUILTIN_TASKS), include_defaults=False)
    items = sum(len(list(t.eval_docs)) for t in tm.load(args.tasks)["tasks"].values())
    print(f"{items} items of {', '.join(args.tasks)}, batch size {args.batch_size}, best of {repeat}, "
          f"model loading included")
    for name in ("ours", "harness"):
        print(f"  {name:8s} {best[name]:7.2f} s  {items / best[name]:8.1f} items/s")
    for task, m in sorted(numbers["ours"].items()):
        print(f"  {task}: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items()))
    result("eval_harness", best["harness"] / best["ours"], ">=", 0.9)


if __name__ == "__main__":
    main()
