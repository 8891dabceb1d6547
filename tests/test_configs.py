"""The shipped configs/ load as they are, and the GPU presets make the choices their comments promise.

No GPU here: these check the files (every key validates, the DeepSpeed JSONs merge into a full
DeepSpeed config, the batch arithmetic divides on the intended GPU count), not a GPU run;
``benchmarks/gpu/run.sh`` trains the presets' ``train:`` sections on a GPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpipe.config import load_config
from llmpipe.training.engines import deepspeed_config
from tests.conftest import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DEEPSPEED = sorted((ROOT / "configs" / "deepspeed").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path: Path) -> None:
    cfg = load_config(path)
    t = cfg.train
    assert t.global_batch_size % (t.micro_batch_size * t.launch.world_size) == 0, path.name
    if isinstance(t.deepspeed, str):
        assert (ROOT / t.deepspeed).is_file(), f"{path.name}: train.deepspeed {t.deepspeed} missing"


def test_gpu_presets_key_choices() -> None:
    small = load_config(ROOT / "configs" / "gpu-125m.yaml").train
    assert (small.model.preset, small.precision, small.compile, small.model.attention) == ("125m", "bf16", True, "auto")
    assert (small.launch.device, small.launch.world_size, small.strategy) == ("cuda", 1, "ddp")
    assert small.seq_len is None or small.seq_len == 2048

    big = load_config(ROOT / "configs" / "gpu-1b.yaml").train
    assert (big.model.preset, big.precision, big.compile, big.model.attention) == ("1b", "bf16", True, "auto")
    assert big.launch.device == "cuda" and big.launch.nproc_per_node == 8 and big.launch.nodes == 1
    assert big.strategy in ("fsdp2", "deepspeed")

    multi = load_config(ROOT / "configs" / "gpu-1b-multinode.yaml").train
    assert multi.launch.nodes == 2 and multi.launch.rdzv_endpoint
    # launch: is a run setting: the same global batch on 2 nodes trains the same model as on one
    same = {k: v for k, v in big.model_dump().items() if k not in ("launch", "checkpoint")}
    assert same == {k: v for k, v in multi.model_dump().items() if k not in ("launch", "checkpoint")}


def test_gpu_1b_zero2_alternative_merges() -> None:
    """The ZeRO-2 line in gpu-1b.yaml's comment, as the trainer builds it for 8 ranks."""
    cfg = load_config(ROOT / "configs" / "gpu-1b.yaml",
                      ["train.strategy=deepspeed", "train.deepspeed=configs/deepspeed/gpu-zero2.json"]).train
    ds = deepspeed_config(cfg, 8, ROOT)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 5e8
    # a non-finite loss skips its step through ZeRO's overflow check
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True} and not ds["fp16"]["enabled"]
    assert ds["train_batch_size"] == 256 and ds["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize("path", DEEPSPEED, ids=lambda p: p.name)
def test_deepspeed_files(path: Path) -> None:
    user = json.loads(path.read_text())
    zero = user["zero_optimization"]
    assert zero["stage"] in (1, 2, 3)
    if path.name.startswith("gpu-"):  # the field guide's settings: overlap, contiguous buckets, pinned offload
        assert zero["overlap_comm"] and zero["contiguous_gradients"]
        for part in ("offload_optimizer", "offload_param"):
            if part in zero:
                assert zero[part] == {"device": "cpu", "pin_memory": True}, f"{path.name}: {part}"
