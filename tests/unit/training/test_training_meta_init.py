"""Meta-device initialisation of sharded models: FSDP2 and tensor parallel build the model on the meta
device, shard it, then materialise each rank's shards with the weights the eager build gives for the
same seed (gathered after init: equal bit for bit), so no rank ever holds the whole model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from llmpipe.training.config import TrainConfig
from llmpipe.training.model import build_model, materialize

REPO = Path(__file__).resolve().parents[3]


def test_materialize_equals_the_eager_build(tiny_train) -> None:
    """One process: a meta-built model materialised from the seed equals the eager one, pad row and
    rotary tables included, and the meta build holds no parameter memory."""
    cfg = TrainConfig(**tiny_train(seed=7))
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    eager, _ = build_model(cfg, 128, torch.device("cpu"), token_ids=ids)
    model, _ = build_model(cfg, 128, torch.device("cpu"), token_ids=ids, meta=True)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, torch.device("cpu"), cfg.seed)
    ref = eager.state_dict()
    assert list(model.state_dict()) == list(ref)
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(b, dict(eager.named_buffers())[n]) for n, b in model.named_buffers())
    assert not torch.equal(ref["model.embed_tokens.weight"], build_model(
        TrainConfig(**tiny_train(seed=8)), 128, torch.device("cpu"), token_ids=ids)[0].state_dict()[
        "model.embed_tokens.weight"])  # the seed decides


def _gathered(tmp_path: Path, packed: Path, worker_spec: Any, train: dict[str, Any], nproc: int) -> dict[str, Any]:
    cfg = TrainConfig(**train)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(worker_spec(cfg, packed, tmp_path)))
    out = tmp_path / "state.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    str(Path(__file__).with_name("meta_init_worker.py")), str(spec), str(out)],
                   check=True, env=env, timeout=120, capture_output=True)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", [{"strategy": "fsdp2"}, {"parallel": {"tensor": 2}}], ids=["fsdp2", "tensor2"])
def test_sharded_meta_init_gathers_to_the_eager_weights(case: dict[str, Any], tmp_path: Path, packed: Path,
                                                        tiny_train, worker_spec) -> None:
    train = tiny_train(**case)
    got = _gathered(tmp_path, packed, worker_spec, train, nproc=2)
    assert got["meta"] and got["engine"] == ("fsdp2" if "strategy" in case else "tp")
    eager = build_model(TrainConfig(**train), 128, torch.device("cpu"))[0].state_dict()  # the spec's vocabulary
    assert list(got["state"]) == list(eager)
    assert [k for k, v in got["state"].items() if not torch.equal(v, eager[k])] == []
    assert got["local_numel"] < 0.8 * sum(v.numel() for v in eager.values())  # rank 0 holds its shards only
