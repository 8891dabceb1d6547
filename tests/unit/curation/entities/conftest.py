"""Fixtures for the entity tests: the tiny NER checkpoint, trained once per session (under a lock, as
the toy LM is, so parallel test processes build it once)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_ner_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests.fixtures.tiny_ner import make_tiny_ner

    torch.set_num_threads(1)  # other test processes share the cores
    root = tmp_path_factory.getbasetemp() / "llmpipe-tiny-ner"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "DONE").exists():
            make_tiny_ner(root / "model")
            (root / "DONE").write_text("ok")
    return root / "model"
