"""The learning-rate finder: "verify the learning rate with an LR Finder" (the guides' first check when
training does not converge).

It trains the configured model on the configured data in this process, raising the learning rate
exponentially from ``min_lr`` to ``max_lr`` over ``steps`` steps (Smith 2015, "Cyclical Learning Rates";
the fastai finder), and stops once the loss has clearly diverged. The suggestion follows one of two
rules, both reported: the learning rate of the steepest descent of the smoothed loss (per unit of
log learning rate), or, when the curve never clearly falls, the learning rate of the minimum
divided by 10. Nothing is written to the store: the stage's cache is untouched.

Two ways to run it, the same sweep (:func:`find`, with ``train.lr_find``'s settings unless the command
line overrides them): ``llmpipe lr-find CONFIG`` only suggests; ``train.lr_find.enabled: true`` runs it
inside the pretrain stage first and trains with the suggestion (the stage records the curve, the
learning rate and the rule).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmpipe.training.config import ParallelConfig, TrainConfig
from llmpipe.training.trainer import Trainer

SMOOTHING = 0.9  # exponential moving average of the loss, bias-corrected
DIVERGED = 4.0  # stop when the smoothed loss exceeds this multiple of its minimum


@dataclass(frozen=True)
class Sweep:
    """A finished sweep: learning rate, raw and smoothed loss per step, and the suggestion."""

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggested_lr: float
    rule: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


class SweepTrainer(Trainer):
    """The trainer with an exponential learning-rate ramp instead of the configured schedule."""

    def __init__(self, spec: dict[str, Any], min_lr: float, max_lr: float, steps: int) -> None:
        super().__init__(spec)
        self.min_lr, self.ratio, self.steps = min_lr, max_lr / min_lr, steps

    def learning_rate(self, step: int) -> float:
        return self.min_lr * self.ratio ** (step / max(1, self.steps - 1))


def smooth(losses: list[float], beta: float = SMOOTHING) -> list[float]:
    out, avg = [], 0.0
    for i, x in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * x
        out.append(avg / (1 - beta**i))
    return out


def suggest(lrs: list[float], smoothed: list[float]) -> tuple[float, str]:
    """(learning rate, rule): steepest descent of the smoothed loss, else the minimum's lr / 10."""
    best = min(range(len(smoothed)), key=smoothed.__getitem__)
    slopes = [(smoothed[i + 1] - smoothed[i - 1]) / math.log(lrs[i + 1] / lrs[i - 1])
              for i in range(1, best)]  # d loss / d log lr, on the falling part only
    if slopes and min(slopes) < 0 and smoothed[best] < 0.95 * smoothed[0]:
        steepest = 1 + min(range(len(slopes)), key=slopes.__getitem__)
        return lrs[steepest], "steepest descent of the smoothed loss"
    return lrs[best] / 10, "minimum of the smoothed loss / 10"


def sweep(train: Any, data_dir: Path, seq_len: int, vocab_size: int, *, min_lr: float = 1e-5,
          max_lr: float = 1.0, steps: int = 100, work_dir: Path | None = None) -> Sweep:
    """Run the sweep on ``train`` (a TrainConfig) in this process; stops early once the loss diverges."""
    if not 0 < min_lr < max_lr:
        raise ValueError(f"lr-find: need 0 < min_lr < max_lr, got {min_lr:g} and {max_lr:g}")
    if steps < 10:
        raise ValueError(f"lr-find: steps must be at least 10, got {steps}")
    with tempfile.TemporaryDirectory(prefix="llmpipe-lr-find-", dir=work_dir) as tmp:
        spec = {"train": train.model_dump(mode="json"), "data_dir": str(data_dir), "seq_len": seq_len,
                "vocab_size": vocab_size, "checkpoint_dir": str(Path(tmp) / "checkpoints"),
                "export_dir": str(Path(tmp) / "export"), "run_dir": tmp}
        trainer = SweepTrainer(spec, min_lr, max_lr, steps)
        trainer.setup()
        lrs, losses = [], []
        for step in range(steps):
            trainer.step = step
            rec = trainer.train_step()
            if not math.isfinite(rec["loss"]):
                break
            lrs.append(rec["lr"])
            losses.append(rec["loss"])
            smoothed = smooth(losses)
            if step > 5 and smoothed[-1] > DIVERGED * min(smoothed):
                break
    if len(losses) < 5:
        raise ValueError(f"lr-find: the loss diverged after {len(losses)} steps; lower --min-lr")
    smoothed = smooth(losses)
    lr, rule = suggest(lrs, smoothed)
    return Sweep(lrs, losses, smoothed, lr, rule)


def sweep_config(train: TrainConfig) -> TrainConfig:
    """What the sweep trains: the config in one process (DDP, no model parallelism); which learning rate
    to use does not depend on how the model is sharded."""
    return train.model_copy(update={"strategy": "ddp", "parallel": ParallelConfig()})


def find(train: TrainConfig, data_dir: Path, seq_len: int, vocab_size: int, work_dir: Path | None = None, *,
         min_lr: float | None = None, max_lr: float | None = None, steps: int | None = None) -> Sweep:
    """The sweep of ``llmpipe lr-find`` and of ``train.lr_find``: its settings from ``train.lr_find``
    unless given, on :func:`sweep_config`; frees the device memory it used before returning."""
    opts = train.lr_find
    try:
        return sweep(sweep_config(train), data_dir, seq_len, vocab_size, work_dir=work_dir,
                     min_lr=opts.min_lr if min_lr is None else min_lr,
                     max_lr=opts.max_lr if max_lr is None else max_lr, steps=opts.steps if steps is None else steps)
    finally:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the workers that train next need the memory of this process's model


def plot(result: Sweep, png: Path) -> None:
    """Loss against learning rate (log scale), the suggestion marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(result.lrs, result.losses, alpha=0.35, label="loss")
    ax.plot(result.lrs, result.smoothed, label="smoothed")
    ax.axvline(result.suggested_lr, color="C3", linestyle="--",
               label=f"suggested {result.suggested_lr:.2e} ({result.rule})")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, metadata={"Software": None})
    plt.close(fig)
