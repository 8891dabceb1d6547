"""The stage side of SFT on several processes: write the pairs and spec, start ``sft_worker`` under torchrun.

Kept apart from the worker (``llmpipe.posttrain.sft_worker``), which loads and saves the model with
the stage's helpers: the stage imports this module, the worker imports the stage, and neither imports
the other back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmpipe.posttrain.data import Pair

WORKER_MODULE = "llmpipe.posttrain.sft_worker"
PAIRS_FILE = "pairs.jsonl"


def write_pairs(pairs: list[Pair], path: Path) -> None:
    """The training pairs, in order, for the workers (each reads them all and takes its share per step)."""
    path.write_text("".join(json.dumps({"prompt": [list(m) for m in p.prompt], "response": p.response},
                                       ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")


def read_pairs(path: Path) -> list[Pair]:
    """What :func:`write_pairs` wrote, as the same pairs (in the worker)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [Pair(tuple((r, c) for r, c in row["prompt"]), row["response"]) for row in rows]


def launch_sft(cfg: Any, src: Path, pairs: list[Pair], out: Path, run_dir: Path,
               on_log: Any = None, on_step: Any = None, rdzv_id: str = "llmpipe-sft") -> Any:
    """Train ``pairs`` from the model folder ``src`` on ``cfg.launch.nproc_per_node`` torchrun workers
    (``cfg``: the ``sft`` section) and save the model folder into ``out``; the ``LaunchResult``
    (``metrics``: one record per step; ``summary``: rank 0's step shapes and training seconds)."""
    from llmpipe.training.launch import launch

    run_dir.mkdir(parents=True, exist_ok=True)
    write_pairs(pairs, run_dir / PAIRS_FILE)
    spec = {"sft": cfg.model_dump(mode="json"), "src": str(src), "out": str(out),
            "pairs": str(run_dir / PAIRS_FILE)}
    on_metric = None if on_step is None else (lambda rec: on_step(int(rec["step"]), float(rec["loss"])))
    return launch(cfg.launch, spec, run_dir, on_log=on_log, on_metric=on_metric, rdzv_id=rdzv_id,
                  module=WORKER_MODULE)
