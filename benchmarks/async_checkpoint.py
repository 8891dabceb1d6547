"""How long a checkpoint holds up training: synchronous vs asynchronous DCP saves (``train.checkpoint.async_save``).

Two runs of the same tiny model under torchrun (2 CPU processes, gloo, DDP, 1 thread each), a
checkpoint every 2 steps, one with ``async_save: false`` and one with ``true``. Each save logs how long
``save_checkpoint`` kept the loop from its next step (``checkpoint step N: training blocked Xs``): the
whole write when synchronous; the staging copy into CPU memory when asynchronous, the write then
running in a thread beside the next steps. The step that runs beside a write is timed too (its
``step_time_s``) against the steps that do not, to show what the background write costs the step.
The final save is left out (the run waits for it before the export either way). The cost of a save
to the run: its stall plus what it slowed the step beside it (beside minus other steps, if more).
Goal: an asynchronous save costs at most half a synchronous one.

Usage: python benchmarks/async_checkpoint.py [--steps 20] [--every 2] [--hidden 64] [--layers 2] [--quick]
"""

from __future__ import annotations

import os
import sys

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from llmpipe.training.config import TrainConfig  # noqa: E402
from llmpipe.training.data import write_npy_fixture  # noqa: E402
from llmpipe.training.launch import launch  # noqa: E402

VOCAB, SEQ = 128, 64
BLOCKED = re.compile(r"training blocked ([0-9.]+)s")


def run(root: Path, data: Path, args: argparse.Namespace, asynchronous: bool) -> dict[str, float]:
    """One 2-rank run; the median stall per save (final save excluded) and step times beside / away from a write."""
    model = {"overrides": {"hidden_size": args.hidden, "num_hidden_layers": args.layers,
                           "intermediate_size": 3 * args.hidden}}
    cfg = TrainConfig(max_steps=args.steps, global_batch_size=8, micro_batch_size=4, optimizer={"lr": 3e-3},
                      schedule={"warmup_steps": 1}, model=model,
                      checkpoint={"every": args.every, "keep": 2, "async_save": asynchronous},
                      launch={"nproc_per_node": 2, "timeout_s": 900, "threads_per_process": 1})
    spec = {"train": cfg.model_dump(mode="json"), "data_dir": str(data), "seq_len": SEQ, "vocab_size": VOCAB,
            "checkpoint_dir": str(root / "checkpoints"), "export_dir": str(root / "export"), "run_dir": str(root)}
    lines: list[str] = []
    launch(cfg.launch, spec, root, on_log=lines.append)
    blocked = [float(m.group(1)) for ln in lines if (m := BLOCKED.search(ln))][:-1]
    recs = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    beside = [r["step_time_s"] for r in recs if r["step"] > args.every and r["step"] % args.every == 1]
    away = [r["step_time_s"] for r in recs if r["step"] > args.every and r["step"] % args.every != 1]
    return {"blocked": statistics.median(blocked), "saves": len(blocked), "beside": statistics.median(beside),
            "away": statistics.median(away)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="8 steps (the suite's check that the script works)")
    args = ap.parse_args()
    if args.quick:
        args.steps = 8
    with tempfile.TemporaryDirectory() as tmp:
        data = write_npy_fixture(Path(tmp) / "data", n=256, seq_len=SEQ, vocab_size=VOCAB, seed=0)
        out = {mode: run(Path(tmp) / f"async_{mode}", data, args, mode) for mode in (False, True)}
    for mode, r in out.items():
        print(f"async_save={str(mode).lower():5}: training blocked {1e3 * r['blocked']:.1f} ms per save "
              f"(median of {r['saves']}); the step beside a write {1e3 * r['beside']:.1f} ms, "
              f"other steps {1e3 * r['away']:.1f} ms")
    cost = {mode: r["blocked"] + max(0.0, r["beside"] - r["away"]) for mode, r in out.items()}
    print(f"cost per save: synchronous {1e3 * cost[False]:.1f} ms, asynchronous {1e3 * cost[True]:.1f} ms")
    print(f"RESULT async_vs_sync_save_cost {cost[True] / cost[False]:.3f} goal <= 0.5")


if __name__ == "__main__":
    main()
