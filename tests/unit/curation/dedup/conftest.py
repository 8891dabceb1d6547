"""Fixtures for the dedup tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpipe.store import ArtifactStore


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")
