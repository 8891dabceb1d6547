"""Fixtures for the serving tests: a tiny Llama checkpoint with its own trained tokenizer (no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serving") / "ckpt")
