"""The LR finder on the tiny model: the curve falls then rises, and its suggestion trains best."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmpipe.training.config import TrainConfig
from llmpipe.training.lr_finder import plot, suggest, sweep
from llmpipe.training.trainer import Trainer
from tests.unit.training.conftest import SEQ, VOCAB


def _final_loss(tmp: Path, packed: Path, worker_spec, tiny_train, lr: float, steps: int = 50) -> float:
    cfg = TrainConfig(**tiny_train(max_steps=steps, optimizer={"lr": lr}, schedule={"kind": "constant",
                                   "warmup_steps": 0}, checkpoint={"every": 0}, launch={"nproc_per_node": 1}))
    trainer = Trainer(worker_spec(cfg, packed, tmp))
    trainer.setup()
    losses = []
    for step in range(steps):
        trainer.step = step
        losses.append(trainer.train_step()["loss"])
    return sum(losses[-5:]) / 5


@pytest.mark.slow  # about 20 CPU-seconds: the sweep, then three 50-step runs
def test_the_curve_falls_then_rises_and_the_suggestion_beats_ten_times_either_way(
        tmp_path: Path, packed: Path, worker_spec, tiny_train) -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(**tiny_train(launch={"nproc_per_node": 1}))
    result = sweep(cfg, packed, SEQ, VOCAB, min_lr=1e-5, max_lr=10.0, steps=120, work_dir=tmp_path)
    low = min(range(len(result.smoothed)), key=result.smoothed.__getitem__)
    assert 0 < low < len(result.smoothed) - 1, "no minimum inside the sweep"
    assert result.smoothed[low] < 0.9 * result.smoothed[0] and result.smoothed[-1] > 1.2 * result.smoothed[low]
    assert result.rule == "steepest descent of the smoothed loss"
    plot(result, tmp_path / "lr.png")
    assert (tmp_path / "lr.png").stat().st_size > 1000
    lr = result.suggested_lr
    losses = {f: _final_loss(tmp_path / str(f), packed, worker_spec, tiny_train, lr * f) for f in (0.1, 1, 10)}
    assert losses[1] < losses[0.1] and losses[1] < losses[10], (lr, losses)


def test_a_curve_that_never_falls_suggests_the_minimum_over_ten() -> None:
    lrs = [10.0 ** (i / 4 - 5) for i in range(20)]
    assert suggest(lrs, [5.0 + i * 0.1 for i in range(20)]) == (lrs[0] / 10, "minimum of the smoothed loss / 10")
