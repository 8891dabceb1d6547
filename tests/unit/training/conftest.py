"""Shared fixtures of the training tests: a tiny packed dataset and a tiny-model config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmpipe.training.data import write_npy_fixture

VOCAB = 128
SEQ = 32


@pytest.fixture(scope="session")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 learnable sequences of 32 tokens in the npy packed layout (2 shards)."""
    return write_npy_fixture(tmp_path_factory.mktemp("packed"), n=64, seq_len=SEQ, vocab_size=VOCAB, seed=0)


def _tiny_train(**over: Any) -> dict[str, Any]:
    """A ``train:`` section that runs in a second: tiny model, fp32, lr high enough to learn in 8 steps.

    A sub-section in ``over`` is merged into the base one: ``launch={"nproc_per_node": 1}`` keeps the
    other launch settings. Checkpoints are written synchronously, so a test that kills a run after a
    save finds it complete (``test_training_async_save.py`` runs the asynchronous ones).
    """
    base: dict[str, Any] = dict(max_steps=6, global_batch_size=8, micro_batch_size=2,
                                optimizer={"lr": 3e-3}, schedule={"warmup_steps": 1},
                                checkpoint={"every": 3, "keep": 2, "async_save": False},
                                launch={"nproc_per_node": 2, "timeout_s": 900, "threads_per_process": 1})
    for key, value in over.items():
        merge = isinstance(value, dict) and isinstance(base.get(key), dict)
        base[key] = {**base[key], **value} if merge else value
    return base


def _worker_spec(train: Any, data: Path, run_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"train": train.model_dump(mode="json"), "data_dir": str(data), "seq_len": SEQ, "vocab_size": VOCAB,
            "checkpoint_dir": str(run_dir / "checkpoints"), "export_dir": str(run_dir / "export"),
            "run_dir": str(run_dir), **extra}


@pytest.fixture(scope="session")
def tiny_train() -> Any:
    return _tiny_train


@pytest.fixture(scope="session")
def worker_spec() -> Any:
    return _worker_spec
