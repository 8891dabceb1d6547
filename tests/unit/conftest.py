"""Fixtures shared by the evaluation and quantization tests: real tokenizer/tokenize artifacts and a tiny
Llama trained on them (built once per session, only when a test asks for them)."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
import torch


def toy_artifacts(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Build (or reuse within this session) the trained toy model: hidden 128 so groups are 128 wide."""
    from tests.fixtures import toy_model as toy

    torch.set_num_threads(1)  # other test processes share the cores; oversubscription is 10x slower
    root = tmp_path_factory.getbasetemp() / "llmpipe-toy-lm"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "DONE"
        if not done.exists():
            art = toy.build(root / "a", hidden=128, intermediate=256, steps=150)
            done.write_text(str(art.final_loss))
    a = root / "a"
    return toy.ToyArtifacts(a / "store", a / "augment", a / "tokenizer", a / "tokenize", a / "pretrain",
                            float((root / "DONE").read_text()))


@pytest.fixture(scope="session")
def toy_lm(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return toy_artifacts(tmp_path_factory)


@pytest.fixture
def fresh_store(tmp_path: Path):  # noqa: ANN201
    from llmpipe.store import ArtifactStore

    return ArtifactStore(tmp_path / "store")
