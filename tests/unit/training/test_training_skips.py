"""A non-finite step is skipped whole under every engine: no weight, no optimizer moment and no step
count changes. Rank 0's loss is NaN at step 3 of 4 (2 ranks, 2 micro-batches each, so rank 1's
finite gradients and rank 0's first micro-batch are in the step too); every rank hashes its own part
of the weights and of the optimizer state after each step, and the hash after step 3 must equal the
one after step 2 while step 4 trains again. DeepSpeed goes first: it used to zero the learning rate
and backpropagate a zero loss, so AdamW still advanced its step count and moments. The same runs
check what each engine's ranks imported (``tests/fixtures/rank_imports.py``): no launch of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpipe.training.config import TrainConfig
from llmpipe.training.launch import launch
from tests.fixtures import faulty_trainer
from tests.fixtures.rank_imports import modules_file, unneeded

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]

ENGINES = {
    "zero1": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero1.json")},
    "zero2": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero2.json")},
    "zero3": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero3.json")},
    # bf16: ZeRO's overflow check on (bf16.check_grad_overflow), gradients communicated in fp32
    "zero2_bf16": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero2.json"),
                   "precision": "bf16"},
    "ddp": {"strategy": "ddp"},
    "fsdp2": {"strategy": "fsdp2"},
    "tensor2": {"parallel": {"tensor": 2}},
    "pipeline2": {"parallel": {"pipeline": 2}},
}


@pytest.mark.parametrize("case", list(ENGINES))
def test_a_nan_step_changes_no_weight_and_no_optimizer_state(case: str, tmp_path: Path, packed: Path,
                                                             tiny_train, worker_spec) -> None:
    cfg = TrainConfig(**tiny_train(**ENGINES[case], max_steps=4, checkpoint={"every": 0}))
    launch(cfg.launch, worker_spec(cfg, packed, tmp_path, test_nan_steps=[2], test_state_digest=True,
                                      test_modules=True), tmp_path,
           env={"PYTHONPATH": str(REPO)}, module=faulty_trainer.MODULE)
    for rank in (0, 1):
        recs = [json.loads(x) for x in (tmp_path / f"digest_rank{rank}.jsonl").read_text().splitlines()]
        assert [(r["step"], r["skipped"]) for r in recs] == [(1, False), (2, False), (3, True), (4, False)]
        two, three, four = recs[1], recs[2], recs[3]
        for part in ("weights", "optimizer"):
            assert three[part] == two[part], f"rank {rank}: the skipped step changed the {part}"
            assert four[part] != three[part], f"rank {rank}: step 4 did not train ({part})"
        mods = json.loads(modules_file(tmp_path, rank).read_text())
        assert "transformers" in mods and not unneeded(mods), f"rank {rank} imported {unneeded(mods)}"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["nonfinite_steps"] == 1 and summary["steps"] == 4
