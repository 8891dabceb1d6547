"""Resume that checks before it loads: a 2-rank DDP run resumed as FSDP2 and as tensor parallel (DCP
reshards its checkpoint) matches the uninterrupted DDP run; resumed as a pipeline it stops with one
line naming the changed setting. The layout rules themselves run without processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from llmpipe.training.config import TrainConfig
from llmpipe.training.launch import TrainingError, launch
from llmpipe.training.resume import CheckpointLayout, ResumeMismatch, check

DDP2 = CheckpointLayout("dcp", "ddp", "ddp", 2)


def test_same_layout_loads_and_dcp_engines_reshard() -> None:
    assert check(DDP2, DDP2, "c/step_3") is False
    assert check(DDP2, CheckpointLayout("dcp", "fsdp2", "fsdp2", 2), "c/step_3") is True
    assert check(DDP2, CheckpointLayout("dcp", "tp", "ddp", 4, tensor=2), "c/step_3") is True
    legacy = CheckpointLayout("torch", "ddp", "ddp", 2)  # DDP's one file: a full state dict
    assert check(legacy, CheckpointLayout("dcp", "ddp", "ddp", 1), "c/step_3") is False


@pytest.mark.parametrize(("saved", "now", "line"), [
    (DDP2, CheckpointLayout("pipeline", "pp", "ddp", 2, pipeline=2),
     r"^cannot resume from c/step_3: train\.parallel\.pipeline is 2 now but was 1 when it was saved \(ddp engine, "
     r"dcp checkpoint, world 2\).*set train\.parallel\.pipeline back to 1, or start afresh with "
     r"train\.checkpoint\.resume: false"),
    (CheckpointLayout("deepspeed", "deepspeed", "deepspeed", 2, zero_stage=2),
     CheckpointLayout("deepspeed", "deepspeed", "deepspeed", 4, zero_stage=2),
     r"the world size \(train\.launch\.nodes x train\.launch\.nproc_per_node\) is 4 now but was 2"),
    (CheckpointLayout("deepspeed", "deepspeed", "deepspeed", 2, zero_stage=2), CheckpointLayout("dcp", "fsdp2", "fsdp2", 2),
     r"train\.strategy is fsdp2 now but was deepspeed"),
    (CheckpointLayout("deepspeed", "deepspeed", "deepspeed", 2, zero_stage=2),
     CheckpointLayout("deepspeed", "deepspeed", "deepspeed", 2, zero_stage=3),
     r"zero_optimization\.stage is 3 now but was 2"),
])
def test_a_layout_no_engine_can_read_stops_with_one_line(saved: CheckpointLayout, now: CheckpointLayout,
                                                         line: str) -> None:
    with pytest.raises(ResumeMismatch, match=line) as e:
        check(saved, now, "c/step_3")
    assert "\n" not in str(e.value)


def test_checkpoints_written_before_layouts_are_read_from_their_files(tmp_path: Path) -> None:
    (tmp_path / "model_optim.pt").write_bytes(b"")
    assert CheckpointLayout.read({"world": 2}, tmp_path) == CheckpointLayout("torch", "ddp", "ddp", 2)
    assert CheckpointLayout.read({"layout": DDP2.to_json()}, tmp_path) == DDP2


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train, worker_spec) -> dict[str, Any]:
    """6 DDP steps on 2 ranks, checkpoints at 3 and 6: the reference and the checkpoint to resume."""
    root = tmp_path_factory.mktemp("ddp")
    cfg = TrainConfig(**tiny_train())
    launch(cfg.launch, worker_spec(cfg, packed, root), root)
    losses = [json.loads(x)["loss"] for x in (root / "metrics.jsonl").read_text().splitlines()]
    return {"root": root, "losses": losses}


def _resume_as(ddp_run: dict[str, Any], root: Path, packed: Path, train: dict[str, Any], worker_spec) -> list[float]:
    """Start ``train`` in a folder holding only the DDP run's step-3 checkpoint and its metrics."""
    shutil.copytree(ddp_run["root"] / "checkpoints/step_00000003", root / "checkpoints/step_00000003")
    shutil.copy(ddp_run["root"] / "metrics.jsonl", root / "metrics.jsonl")
    cfg = TrainConfig(**train)
    launch(cfg.launch, worker_spec(cfg, packed, root), root)
    return [json.loads(x)["loss"] for x in (root / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("case", [{"strategy": "fsdp2"}, {"parallel": {"tensor": 2}}], ids=["fsdp2", "tensor2"])
def test_a_ddp_checkpoint_resumes_resharded(case: dict[str, Any], ddp_run: dict[str, Any], tmp_path: Path,
                                            packed: Path, tiny_train, worker_spec) -> None:
    state = json.loads((ddp_run["root"] / "checkpoints/step_00000003/state.json").read_text())
    assert state["layout"] == {**DDP2.to_json()}
    losses = _resume_as(ddp_run, tmp_path, packed, tiny_train(**case), worker_spec)
    ref = ddp_run["losses"]
    assert len(losses) == 6 and losses[:3] == ref[:3]
    assert max(abs(a - b) for a, b in zip(losses[3:], ref[3:], strict=True)) <= 1e-5, (losses, ref)


@pytest.mark.slow
def test_a_ddp_checkpoint_resumed_as_a_pipeline_stops_before_loading(ddp_run: dict[str, Any], tmp_path: Path,
                                                                     packed: Path, tiny_train, worker_spec) -> None:
    with pytest.raises(TrainingError, match=r"ResumeMismatch: cannot resume from checkpoints/step_00000003: "
                                            r"train\.parallel\.pipeline is 2 now but was 1"):
        _resume_as(ddp_run, tmp_path, packed, tiny_train(parallel={"pipeline": 2}), worker_spec)
