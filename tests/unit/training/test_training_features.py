"""Training features that change how a step runs, checked in one process: bf16 autocast on CPU,
gradient checkpointing, and ``model.init_from`` (continue from a ``save_pretrained`` folder).

The cosine-with-warm-restarts schedule is covered by ``test_training_unit.py``; ``torch.compile``
is left out (its CPU inductor build of the tiny model takes about a minute on 2 cores).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from llmpipe.training.config import TrainConfig
from llmpipe.training.trainer import Trainer
from tests.fixtures.threads import one_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    with one_thread():
        yield


def _trainer(run_dir: Path, packed: Path, tiny_train: Any, worker_spec: Any, **over: Any) -> Trainer:
    """A set-up world-1 trainer: 2 micro-batches of 2 sequences per step, no checkpoints."""
    assert "RANK" not in os.environ
    kw: dict[str, Any] = dict(launch={"nproc_per_node": 1, "device": "cpu"}, checkpoint={"every": 0},
                              global_batch_size=4, micro_batch_size=2)
    kw.update(over)
    tr = Trainer(worker_spec(TrainConfig(**tiny_train(**kw)), packed, run_dir))
    tr.setup()
    return tr


def _steps(tr: Trainer, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        rec = tr.train_step()
        tr.step += 1
        assert not rec["skipped"]
        losses.append(rec["loss"])
    return losses


def _module(tr: Trainer) -> torch.nn.Module:
    return tr.engine.module


def test_bf16_runs_the_forward_under_cpu_autocast(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    seen: list[torch.dtype] = []
    runs = {}
    for prec in ("fp32", "bf16"):
        tr = _trainer(tmp_path / prec, packed, tiny_train, worker_spec, precision=prec)
        assert next(_module(tr).parameters()).dtype == torch.float32  # master weights stay fp32
        if prec == "bf16":
            proj = _module(tr).model.layers[0].mlp.down_proj
            proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        runs[prec] = _steps(tr, 3)
        assert next(_module(tr).parameters()).dtype == torch.float32
    assert seen and set(seen) == {torch.bfloat16}
    assert all(math.isfinite(x) for v in runs.values() for x in v)
    # same seed, same data: only the matmul precision differs
    assert runs["bf16"][0] != runs["fp32"][0]
    assert runs["bf16"][0] == pytest.approx(runs["fp32"][0], rel=2e-2)


def _count_layer_calls(tr: Trainer) -> list[int]:
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    # a pre-hook: the recompute may stop early (before the layer's post-hooks) once it has what it needs
    _module(tr).model.layers[0].register_forward_pre_hook(hook)
    return calls


def _assert_checkpointing_matches(base: Trainer, ckpt: Trainer) -> None:
    assert ckpt.cfg.gradient_checkpointing and not base.cfg.gradient_checkpointing
    assert _module(ckpt).is_gradient_checkpointing and not _module(base).is_gradient_checkpointing
    n_base, n_ckpt = _count_layer_calls(base), _count_layer_calls(ckpt)
    l_base, l_ckpt = _steps(base, 2), _steps(ckpt, 2)
    micro = 2 * base.order.accum
    # non-reentrant checkpointing starts each decoder layer's forward again during backward
    assert n_base[0] == micro and n_ckpt[0] == 2 * micro
    assert all(math.isfinite(x) for x in l_base + l_ckpt)
    assert l_ckpt == pytest.approx(l_base, rel=1e-5, abs=1e-6)
    for (name, p), q in zip(_module(base).named_parameters(), _module(ckpt).parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_recomputes_and_matches(tmp_path: Path, packed: Path, tiny_train,
                                                       worker_spec) -> None:
    base = _trainer(tmp_path / "base", packed, tiny_train, worker_spec)
    ckpt = _trainer(tmp_path / "ckpt", packed, tiny_train, worker_spec, gradient_checkpointing=True)
    _assert_checkpointing_matches(base, ckpt)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train, worker_spec) -> Path:
    """A ``save_pretrained`` export of a short run (what ``init_from`` points at)."""
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("pretrained")
    tr = Trainer(worker_spec(TrainConfig(**tiny_train(launch={"nproc_per_node": 1, "device": "cpu"},
                                                      checkpoint={"every": 0}, max_steps=6)), packed, run))
    tr.run()
    assert (run / "export/model.safetensors").exists()
    return run / "export"


def test_init_from_starts_at_the_checkpoint(tmp_path: Path, packed: Path, pretrained: Path, tiny_train,
                                            worker_spec) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(pretrained / "model.safetensors"))
    cont = _trainer(tmp_path / "cont", packed, tiny_train, worker_spec, model={"init_from": str(pretrained)})
    scratch = _trainer(tmp_path / "scratch", packed, tiny_train, worker_spec)
    sd = _module(cont).state_dict()
    assert set(sd) == set(saved)
    for k, v in saved.items():
        assert torch.equal(sd[k], v), k
    assert not torch.equal(_module(scratch).state_dict()["lm_head.weight"], saved["lm_head.weight"])
    l_cont, l_scratch = _steps(cont, 2), _steps(scratch, 2)
    assert all(math.isfinite(x) for x in l_cont + l_scratch)
    assert l_cont[0] < l_scratch[0] - 0.3  # the checkpoint had already learned the data


def test_init_from_with_gradient_checkpointing(tmp_path: Path, packed: Path, pretrained: Path, tiny_train,
                                               worker_spec) -> None:
    """``from_pretrained`` returns an eval-mode model; checkpointing (and training mode) must still apply."""
    init = {"init_from": str(pretrained)}
    base = _trainer(tmp_path / "base", packed, tiny_train, worker_spec, model=init)
    ckpt = _trainer(tmp_path / "ckpt", packed, tiny_train, worker_spec, model=init, gradient_checkpointing=True)
    assert _module(base).training and _module(ckpt).training
    _assert_checkpointing_matches(base, ckpt)
