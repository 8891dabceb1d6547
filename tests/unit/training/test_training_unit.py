"""Training library pieces that run in one process: config checks, schedule, data order, commands, guards."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from llmpipe.config import ConfigError, load_config
from llmpipe.training.config import LaunchConfig, TrainConfig
from llmpipe.training.data import GlobalOrder, open_packed
from llmpipe.training.engines import deepspeed_config
from llmpipe.training.launch import TrainingError, build_command
from llmpipe.training.stage import plan
from llmpipe.training.trainer import Trainer, lr_at
from tests.fixtures.faulty_trainer import FaultyTrainer

REPO = Path(__file__).resolve().parents[3]


def test_unknown_strategy_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"train\.strategy"):
        load_config(data={"train": {"strategy": "megatron"}})


def test_micro_batch_must_divide_global_batch() -> None:
    with pytest.raises(ConfigError, match=r"train: .*global_batch_size \(10\).*micro_batch_size \(4\)"):
        load_config(data={"train": {"global_batch_size": 10, "micro_batch_size": 4}})


def test_each_check_names_its_sub_section() -> None:
    """A check sits in the section that holds its fields, so the error line names that section."""
    cases = [
        ({"launch": {"nodes": 2, "node_rank": 2, "rdzv_endpoint": "h0:1"}},
         r"train\.launch: node_rank must be < nodes \(2\), got 2"),
        ({"launch": {"nodes": 2}}, r"train\.launch: nodes > 1 needs rdzv_endpoint \(torchrun\) or hostfile"),
        ({"launch": {"launcher": "deepspeed"}},
         r"train: launch\.launcher 'deepspeed' needs strategy 'deepspeed', got 'ddp'"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, r"train\.optimizer\.betas: each beta must be in \[0, 1\)"),
        ({"schedule": {"kind": "linear"}}, r"train\.schedule\.kind: Input should be 'cosine'"),
        ({"checkpoint": {"keep": 0}}, r"train\.checkpoint\.keep: Input should be greater than 0"),
    ]
    for train, line in cases:
        with pytest.raises(ConfigError, match=rf"^<config>: {line}"):
            load_config(data={"train": train})


def test_checkpoint_and_launch_stay_out_of_the_key() -> None:
    """How the run is carried out (cadence, topology, timeouts) never changes the stage key; the
    optimizer, schedule and guards do."""
    base = TrainConfig().key_dict()
    run = TrainConfig(log_every=5, checkpoint={"every": 0, "keep": 5, "dir": "elsewhere", "resume": False},
                      launch={"nodes": 2, "node_rank": 1, "nproc_per_node": 8, "rdzv_endpoint": "h0:29400",
                              "device": "cuda", "timeout_s": 10, "threads_per_process": 3})
    assert run.key_dict() == base and base["checkpoint"] == base["launch"] == {}
    for section, value in (("optimizer", {"eps": 1e-6}), ("schedule", {"kind": "constant"}),
                           ("guards", {"spike_factor": 4})):
        assert TrainConfig(**{section: value}).key_dict() != base, section


def test_plan_rejects_world_size_mismatch(packed: Path, tiny_train) -> None:
    cfg = TrainConfig(**tiny_train(global_batch_size=6, micro_batch_size=2, launch={"nproc_per_node": 2}))
    with pytest.raises(TrainingError, match=r"^train\.global_batch_size: .*\(2 x 2 = 4\), got 6"):
        plan(cfg, packed, 128)


def test_plan_rejects_long_sequences_and_missing_shards(packed: Path, tmp_path: Path, tiny_train) -> None:
    with pytest.raises(TrainingError, match=r"^train\.seq_len: 64 is longer than the packed sequences \(32\)"):
        plan(TrainConfig(**tiny_train(seq_len=64)), packed, 128)
    small = TrainConfig(**tiny_train(model={"overrides": {"max_position_embeddings": 16}}))
    with pytest.raises(TrainingError, match=r"^train\.seq_len: 32 exceeds the model's max_position_embeddings"):
        plan(small, packed, 128)
    with pytest.raises(TrainingError, match=r"^train\.split: missing shards"):
        plan(TrainConfig(**tiny_train()), tmp_path, 128)
    with pytest.raises(TrainingError, match=r"^train\.precision"):
        plan(TrainConfig(**tiny_train(precision="fp16", launch={"device": "cpu"})), packed, 128)
    stage0 = TrainConfig(**tiny_train(strategy="deepspeed", deepspeed={"zero_optimization": {"stage": 0}}))
    with pytest.raises(TrainingError, match=r"^train\.deepspeed: zero_optimization\.stage must be 1, 2 or 3 "
                                            r"\(stage 0 steps over non-finite gradients\)"):
        plan(stage0, packed, 128)
    ok = plan(TrainConfig(**tiny_train()), packed, 128)
    assert ok["accumulation"] == 2 and ok["seq_len"] == 32 and ok["sequences"] == 64


def test_schedule_warmup_cosine_and_restarts() -> None:
    sched = {"min_lr_ratio": 0.1, "warmup_steps": 4}
    cfg = TrainConfig(optimizer={"lr": 1.0}, schedule=sched, max_steps=104)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(54, cfg) == pytest.approx(0.55)
    assert lr_at(104, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(4, 104)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    r = TrainConfig(optimizer={"lr": 1.0}, schedule={**sched, "kind": "cosine_restarts", "restart_period": 10},
                    max_steps=104)
    assert lr_at(4, r) == pytest.approx(1.0) and lr_at(14, r) == pytest.approx(1.0)
    assert lr_at(13, r) < 0.2


def test_global_order_is_independent_of_world_size() -> None:
    """The same global batch per step on 1x4, 2x2 and 4x1 processes; every sequence once per epoch."""
    def step_set(world: int, step: int) -> list[int]:
        o = GlobalOrder(40, seed=7, global_batch=8, micro_batch=2, world=world)
        return sorted(i for a in range(o.accum) for r in range(world) for i in o.indices(step, a, r))

    for step in (0, 3, 7):
        assert step_set(1, step) == step_set(2, step) == step_set(4, step)
    epoch = [i for s in range(5) for i in step_set(2, s)]
    assert sorted(epoch) == list(range(40))
    assert step_set(2, 5) != step_set(2, 0)  # the next epoch is reshuffled
    with pytest.raises(ValueError, match="not divisible"):
        GlobalOrder(40, 0, 6, 2, 2)


def test_packed_reader(packed: Path) -> None:
    src = open_packed(packed, "train")
    assert len(src) == 64 and src.seq_len == 32
    x, y = src[63]
    assert len(x) == len(y) == 32 and torch.equal(x[1:], y[:-1])


def test_commands_single_multi_node_and_deepspeed(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    single = build_command(LaunchConfig(nproc_per_node=3, master_port=29511), spec, tmp_path, python="py")
    assert single[:3] == ["py", "-m", "torch.distributed.run"]
    assert ["--nproc_per_node", "3"] == single[3:5] and "127.0.0.1:29511" in single
    assert single[-4:] == ["-m", "llmpipe.training.trainer", "--config", str(spec)]
    multi = build_command(LaunchConfig(nodes=2, node_rank=1, nproc_per_node=8, rdzv_endpoint="node0:29400",
                                       rdzv_id="job7"), spec, tmp_path, python="py")
    joined = " ".join(multi)
    assert "--nnodes 2 --node_rank 1" in joined and "--rdzv_endpoint node0:29400" in joined
    assert "--rdzv_id job7" in joined and "--rdzv_backend c10d" in joined
    ds_cfg = TrainConfig(strategy="deepspeed", launch={"launcher": "deepspeed", "nodes": 2, "hostfile": "hosts"})
    ds = build_command(ds_cfg.launch, spec, tmp_path, python="py")
    assert ds[:3] == ["py", "-m", "deepspeed.launcher.runner"]
    assert "--hostfile hosts --num_nodes 2" in " ".join(ds) and ds[-2:] == ["--config", str(spec)]
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        LaunchConfig(nodes=2)


def test_deepspeed_config_from_file_fills_batch_and_optimizer() -> None:
    cfg = TrainConfig(strategy="deepspeed", deepspeed=str(REPO / "configs/deepspeed/zero2_offload.json"),
                      global_batch_size=16, micro_batch_size=2, optimizer={"lr": 1e-3, "grad_clip": 0.5})
    ds = deepspeed_config(cfg, world=2)
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["optimizer"]["params"]["lr"] == 1e-3 and ds["gradient_clipping"] == 0.5
    z3 = deepspeed_config(TrainConfig(strategy="deepspeed", deepspeed={"zero_optimization": {"stage": 3}}), 1)
    assert z3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    # CPU: torch's AdamW (no JIT-compiled op); GPU: DeepSpeed's own (DeepSpeedCPUAdam for an offloaded
    # optimizer); 16-bit gradients communicated in fp32, as FSDP2 reduces them
    assert ds["optimizer"]["params"]["torch_adam"] and ds["zero_force_ds_cpu_optimizer"] is False
    gpu = deepspeed_config(cfg, world=2, cuda=True)
    assert not gpu["optimizer"]["params"]["torch_adam"] and "zero_force_ds_cpu_optimizer" not in gpu
    assert "communication_data_type" not in gpu
    bf16 = deepspeed_config(TrainConfig(strategy="deepspeed", precision="bf16"), 1, cuda=True)
    assert bf16["communication_data_type"] == "fp32" and bf16["bf16"]["enabled"]
    for f in sorted((REPO / "configs/deepspeed").glob("*.json")):
        assert "stage" in json.loads(f.read_text())["zero_optimization"], f.name


def _single(tmp_path: Path, packed: Path, worker_spec, cfg: TrainConfig, **extra) -> Trainer:
    assert "RANK" not in os.environ
    return (FaultyTrainer if extra else Trainer)(worker_spec(cfg, packed, tmp_path, **extra))


def test_single_process_trains_and_guards_nan(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """In-process (world 1): loss falls; an injected NaN step is skipped and counted, weights untouched."""
    torch.set_num_threads(1)
    cfg = TrainConfig(**tiny_train(max_steps=8, launch={"nproc_per_node": 1}, checkpoint={"every": 0}))
    tr = _single(tmp_path / "a", packed, worker_spec, cfg, test_nan_steps=[4])
    summary = tr.run()
    recs = [json.loads(x) for x in (tmp_path / "a/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert summary["nonfinite_steps"] == 1 and recs[4]["skipped"] and math.isnan(recs[4]["loss"])
    good = [r["loss"] for r in recs if not r["skipped"]]
    assert all(math.isfinite(x) for x in good) and good[-1] < good[0] - 0.3
    assert all(r["tokens_per_s"] > 0 and r["flops_per_s"] > 0 and r["peak_mem_mb"] > 0 for r in recs)
    assert (tmp_path / "a/export/model.safetensors").exists()


def test_abort_after_consecutive_nonfinite(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    cfg = TrainConfig(**tiny_train(max_steps=8, launch={"nproc_per_node": 1}, checkpoint={"every": 0},
                                   guards={"max_consecutive_nonfinite": 2}))
    tr = _single(tmp_path, packed, worker_spec, cfg, test_nan_steps=[2, 3, 4])
    with pytest.raises(RuntimeError, match=r"non-finite for 2 steps in a row \(steps 3\.\.4; "
                                            r"train\.guards\.max_consecutive_nonfinite=2\)"):
        tr.run()
