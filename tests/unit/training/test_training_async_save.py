"""Asynchronous DCP checkpoints (``train.checkpoint.async_save``): the write runs behind the next steps,
a checkpoint counts only once committed, at most one save is in flight, the final checkpoint and the
export wait for every pending save, and the artifact's bytes are those of a synchronous run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from llmpipe.training.config import TrainConfig
from llmpipe.training.launch import launch
from llmpipe.training.trainer import Trainer


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Bit-exact CPU results need the same thread count in every run (and the machine is shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _trainer(run_dir: Path, packed: Path, tiny_train: Any, worker_spec: Any, **over: Any) -> Trainer:
    assert "RANK" not in os.environ
    kw: dict[str, Any] = dict(launch={"nproc_per_node": 1, "device": "cpu"}, checkpoint={"every": 0, "async_save": True},
                              global_batch_size=4, micro_batch_size=2, max_steps=4)
    kw.update(over)
    return Trainer(worker_spec(TrainConfig(**tiny_train(**kw)), packed, run_dir))


def _step(tr: Trainer) -> None:
    assert not tr.train_step()["skipped"]
    tr.step += 1


def test_an_async_save_counts_only_once_committed(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """A run killed with its write done but not committed resumes from the previous complete
    checkpoint; a second save first commits the one in flight (at most one in flight)."""
    tr = _trainer(tmp_path, packed, tiny_train, worker_spec)
    tr.setup()
    assert tr.engine.saves_async
    _step(tr)
    tr.save_checkpoint()
    assert tr.pending_save is not None and tr.latest_checkpoint() is None  # not complete yet
    _step(tr)  # training goes on while the write runs
    tr.save_checkpoint()  # step 2: commits step 1 first
    assert tr.latest_checkpoint() == tmp_path / "checkpoints/step_00000001"
    tr.pending_save[3].result()  # step 2's files are all written, but it was never committed: "killed" here
    hidden = tmp_path / "checkpoints/.tmp-step_00000002"
    assert (hidden / "dcp/.metadata").is_file() and not (hidden / "state.json").exists()

    again = _trainer(tmp_path, packed, tiny_train, worker_spec)
    again.setup()
    assert again.latest_checkpoint() == tmp_path / "checkpoints/step_00000001"
    again.load_checkpoint(again.latest_checkpoint())
    assert again.step == 1
    _step(again)
    again.save_checkpoint()  # the killed run's hidden folder is dropped, never read
    again.finish_save()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


def test_the_staged_state_is_a_copy(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """Steps taken while the write runs do not leak into it: the checkpoint holds the saved step's weights."""
    import torch.distributed.checkpoint as dcp

    tr = _trainer(tmp_path, packed, tiny_train, worker_spec)
    tr.setup()
    _step(tr)
    saved = {k: v.detach().clone() for k, v in tr.engine.module.state_dict().items()}
    tr.save_checkpoint()
    _step(tr)
    _step(tr)
    tr.finish_save()
    back = {k: torch.empty_like(v) for k, v in saved.items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "checkpoints/step_00000001/dcp"))
    assert all(torch.equal(back[k], saved[k]) for k in saved)
    assert not all(torch.equal(v, tr.engine.module.state_dict()[k]) for k, v in saved.items())


class Stop(Exception):
    pass


def _run(root: Path, packed: Path, worker_spec: Any, train: dict[str, Any], stop_at: int | None = None
         ) -> tuple[bytes, list[str]]:
    cfg = TrainConfig(**train)
    lines: list[str] = []

    def on_metric(rec: dict[str, Any]) -> None:
        if stop_at is not None and rec["step"] >= stop_at:
            raise Stop()

    try:
        launch(cfg.launch, worker_spec(cfg, packed, root), root, on_log=lines.append, on_metric=on_metric)
    except Stop:
        return b"", []
    return (root / "export/model.safetensors").read_bytes(), [ln for ln in lines if "training blocked" in ln]


def _every_2(tiny_train: Any, strategy: str, async_save: bool) -> dict[str, Any]:
    """2 ranks, 6 steps, a checkpoint every 2 steps (all kept)."""
    return tiny_train(strategy=strategy, checkpoint={"every": 2, "keep": 5, "async_save": async_save})


@pytest.fixture(scope="module")
def async_ddp(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train, worker_spec
              ) -> tuple[Path, bytes, list[str]]:
    """One uninterrupted DDP run with async saves every 2 steps: (its folder, its export's bytes, its
    "training blocked" lines). The sync-vs-async test compares it with a sync run, and the killed run
    must end at its bytes: both need exactly this run, so it runs once (a 2-rank launch is ~15 s here)."""
    root = tmp_path_factory.mktemp("async-ddp")
    out, blocked = _run(root, packed, worker_spec, _every_2(tiny_train, "ddp", True))
    return root, out, blocked


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_async_and_sync_runs_export_the_same_bytes(strategy: str, tmp_path: Path, packed: Path, tiny_train,
                                                   worker_spec, request: pytest.FixtureRequest) -> None:
    """2 ranks under torchrun, a checkpoint every 2 of 6 steps: the same export and checkpoints either way."""
    out = {}
    for mode in (True, False):
        if strategy == "ddp" and mode:
            root, out[mode], blocked = request.getfixturevalue("async_ddp")
        else:
            root = tmp_path / str(mode)
            out[mode], blocked = _run(root, packed, worker_spec, _every_2(tiny_train, strategy, mode))
        names = sorted(p.name for p in (root / "checkpoints").iterdir())
        assert names == ["step_00000002", "step_00000004", "step_00000006"], names
        state = json.loads((root / "checkpoints/step_00000004/state.json").read_text())
        assert state["step"] == 4
        assert len(blocked) == 3 and all(("async write under way" in ln) == mode for ln in blocked), blocked
    assert out[True] == out[False]


@pytest.mark.slow
def test_a_run_killed_behind_an_async_save_resumes_to_the_same_bytes(tmp_path: Path, packed: Path, tiny_train,
                                                                     worker_spec,
                                                                     async_ddp: tuple[Path, bytes, list[str]]) -> None:
    """Killed one step after an async save (the write may still be under way): the resume starts from
    the newest committed checkpoint, whichever it is, and ends with the bytes of an uninterrupted run."""
    train = _every_2(tiny_train, "ddp", True)
    _, ref, _ = async_ddp
    root = tmp_path / "killed"
    _run(root, packed, worker_spec, train, stop_at=5)
    assert not (root / "export").exists()
    assert all((p / "state.json").is_file() for p in (root / "checkpoints").glob("step_*"))
    out, _ = _run(root, packed, worker_spec, train)
    assert [json.loads(x)["step"] for x in (root / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert out == ref


@pytest.mark.slow
def test_an_engine_without_async_saves_says_so_and_saves(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """Pipeline stages (2 ranks) save synchronously under ``async_save: true``, saying so in one line."""
    lines: list[str] = []
    cfg = TrainConfig(**tiny_train(parallel={"pipeline": 2}, max_steps=4,
                                   checkpoint={"every": 2, "keep": 5, "async_save": True}))
    launch(cfg.launch, worker_spec(cfg, packed, tmp_path), tmp_path, on_log=lines.append)
    said = [ln for ln in lines if "saves synchronously" in ln]
    assert len(said) == 1 and "the pp engine" in said[0], said
    assert all("async write under way" not in ln for ln in lines)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
