"""The run's watch: a planted leak is reported and a clean run is not; profiler traces; TensorBoard."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from llmpipe.training.config import TrainConfig
from llmpipe.training.trainer import Trainer
from llmpipe.training.watch import LeakWatch
from tests.fixtures.leaky_trainer import LeakyTrainer


def test_the_leak_watch_wants_steady_growth_over_the_window() -> None:
    steady = LeakWatch(window=10, min_mb=8)
    assert all(steady.add(100 + 2 * i) is None for i in range(10))
    assert "memory grew at 10 of the last 10 steps, by 20.0 MiB" in steady.add(120)
    assert steady.add(200) is None  # once
    noisy, small = LeakWatch(window=10, min_mb=8), LeakWatch(window=10, min_mb=8)
    assert all(noisy.add(100 + (i % 2) * 30) is None for i in range(40))
    assert all(small.add(100 + 0.1 * i) is None for i in range(40))


def _run(cls: type[Trainer], root: Path, packed: Path, worker_spec, tiny_train, **over) -> list[dict]:
    cfg = TrainConfig(**tiny_train(max_steps=24, checkpoint={"every": 0}, launch={"nproc_per_node": 1}, **over))
    cls(worker_spec(cfg, packed, root)).run()
    return [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("leaky", [True, False])
def test_a_planted_leak_is_reported_and_a_clean_run_is_not(leaky: bool, tmp_path: Path, packed: Path,
                                                           worker_spec, tiny_train, caplog) -> None:
    torch.set_num_threads(1)
    with caplog.at_level(logging.WARNING, logger="llmpipe.training.watch"):
        recs = _run(LeakyTrainer if leaky else Trainer, tmp_path, packed, worker_spec, tiny_train,
                    watch={"leak_window": 12, "leak_min_mb": 32})
    assert ("a leak?" in caplog.text) is leaky, caplog.text
    if leaky:
        assert "process memory: rss" in caplog.text  # the memory report goes with the warning
    assert all(0 <= r["data_wait_share"] < 1 and r["memory_mb"] > 0 for r in recs)


def test_profiled_steps_leave_chrome_traces_and_tensorboard_gets_the_scalars(
        tmp_path: Path, packed: Path, worker_spec, tiny_train) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.set_num_threads(1)
    _run(Trainer, tmp_path, packed, worker_spec, tiny_train, profile={"steps": [2, 3]})
    traces = sorted((tmp_path / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["trace_rank0_step000002.json", "trace_rank0_step000003.json"]
    assert json.loads(traces[0].read_text())["traceEvents"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/data_wait_share", "train/memory_mb"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 25))
