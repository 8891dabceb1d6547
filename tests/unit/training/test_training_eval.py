"""Evaluation while training (``train.eval_every``) and the warmup-stable-decay schedule."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from llmpipe.config import ConfigError, load_config
from llmpipe.training.config import TrainConfig
from llmpipe.training.data import write_npy_fixture
from llmpipe.training.trainer import Trainer, lr_at


def test_wsd_warms_up_holds_and_decays_linearly_to_the_floor() -> None:
    cfg = TrainConfig(optimizer={"lr": 1.0}, max_steps=100,
                      schedule={"kind": "wsd", "warmup_steps": 4, "min_lr_ratio": 0.1, "decay_ratio": 0.2})
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert all(lr_at(s, cfg) == 1.0 for s in range(4, 80))
    assert lr_at(80, cfg) == pytest.approx(1.0 - 0.9 / 20) and lr_at(99, cfg) == pytest.approx(0.1)
    decay = [lr_at(s, cfg) for s in range(80, 100)]
    assert all(a - b == pytest.approx(0.9 / 20) for a, b in zip(decay, decay[1:], strict=False))
    fixed = TrainConfig(optimizer={"lr": 1.0}, max_steps=100, schedule={"kind": "wsd", "decay_steps": 10})
    assert lr_at(89, fixed) == 1.0 and lr_at(90, fixed) < 1.0


def test_a_wsd_run_extends_from_its_stable_phase() -> None:
    """The stable phase does not depend on max_steps: a 100-step run's steps before its decay have the
    learning rates of a 300-step run's, so its stable-phase checkpoint continues as the longer run."""
    sched = {"kind": "wsd", "warmup_steps": 5, "decay_steps": 20}
    short, long = (TrainConfig(optimizer={"lr": 3e-4}, max_steps=n, schedule=sched) for n in (100, 300))
    assert [lr_at(s, short) for s in range(80)] == [lr_at(s, long) for s in range(80)]
    cosine = [TrainConfig(optimizer={"lr": 3e-4}, max_steps=n, schedule={"warmup_steps": 5}) for n in (100, 300)]
    assert lr_at(50, cosine[0]) != lr_at(50, cosine[1])  # what wsd avoids


def test_a_decay_longer_than_the_run_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train: schedule\.decay_steps \(30\) is longer than the steps after "
                                          r"warmup \(max_steps 20 - schedule\.warmup_steps 2\)"):
        load_config(data={"train": {"max_steps": 20, "schedule": {"kind": "wsd", "decay_steps": 30}}})
    with pytest.raises(ConfigError, match=r"train: eval_every with parallel\.pipeline > 1"):
        load_config(data={"train": {"eval_every": 2, "parallel": {"pipeline": 2}}})


@pytest.fixture(scope="module")
def with_val(tmp_path_factory: pytest.TempPathFactory, packed: Path) -> Path:
    """The session's packed data plus a held-out ``val`` split of 16 sequences from another seed."""
    root = tmp_path_factory.mktemp("with_val")
    shutil.copytree(packed / "train", root / "train")
    write_npy_fixture(root, n=16, seq_len=32, vocab_size=128, seed=1, split="val")
    return root


def _run(root: Path, data: Path, worker_spec, cfg: TrainConfig, **extra) -> list[dict]:
    Trainer(worker_spec(cfg, data, root, **extra)).run()
    return [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]


def test_eval_every_logs_validation_loss_and_bits_per_byte_and_changes_no_training(
        tmp_path: Path, with_val: Path, tiny_train, worker_spec) -> None:
    """One process, 6 steps, a validation pass every 2: the figures on steps 2, 4, 6 only, bits per
    byte = loss / (ln 2 x bytes per token) (every token spells 2 bytes here), the held-out loss falls
    as the model learns, the TensorBoard file has it, and the training losses are bit for bit those
    of the same run without evaluation."""
    torch.set_num_threads(1)
    table = tmp_path / "token_bytes.npy"
    np.save(table, np.full(128, 2, dtype=np.int64))
    base = tiny_train(launch={"nproc_per_node": 1}, checkpoint={"every": 0})
    plain = _run(tmp_path / "plain", with_val, worker_spec, TrainConfig(**base))
    recs = _run(tmp_path / "eval", with_val, worker_spec, TrainConfig(**base, eval_every=2, eval_sequences=8),
                token_bytes=str(table))
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 4, 6]
    assert [r["loss"] for r in recs] == [r["loss"] for r in plain]
    vals = [r for r in recs if "val_loss" in r]
    assert all(r["val_bpb"] == pytest.approx(r["val_loss"] / (2 * math.log(2))) for r in vals)
    assert vals[-1]["val_loss"] < vals[0]["val_loss"] and math.isfinite(vals[0]["val_loss"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "eval/tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/val_loss")] == [2, 4, 6]


def test_a_wsd_checkpoint_from_the_stable_phase_continues_as_the_longer_run(
        tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """An 8-step wsd run's step-4 checkpoint (stable phase), resumed with max_steps 12, gives the
    12-step run's losses at every step, bit for bit (one process)."""
    torch.set_num_threads(1)

    def cfg(steps: int) -> TrainConfig:
        return TrainConfig(**tiny_train(max_steps=steps, launch={"nproc_per_node": 1}, checkpoint={"every": 4, "keep": 3},
                                        schedule={"kind": "wsd", "warmup_steps": 1, "decay_steps": 2}))

    _run(tmp_path / "short", packed, worker_spec, cfg(8))
    longer = tmp_path / "longer"
    shutil.copytree(tmp_path / "short/checkpoints/step_00000004", longer / "checkpoints/step_00000004")
    shutil.copy(tmp_path / "short/metrics.jsonl", longer / "metrics.jsonl")
    extended = _run(longer, packed, worker_spec, cfg(12))
    fresh = _run(tmp_path / "fresh", packed, worker_spec, cfg(12))
    assert [r["step"] for r in extended] == list(range(1, 13))
    assert [r["loss"] for r in extended] == [r["loss"] for r in fresh]
