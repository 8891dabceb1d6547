"""Shared fixtures: every test gets its own store, state folder and Prefect home (never ~/.prefect)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_jsonl(path: Path, records: list[dict | str | bytes]) -> Path:
    """Records as JSON lines; a str or bytes record is written verbatim (for broken lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for r in records:
            if isinstance(r, bytes):
                f.write(r + b"\n")
            elif isinstance(r, str):
                f.write(r.encode() + b"\n")
            else:
                f.write(json.dumps(r, ensure_ascii=False).encode() + b"\n")
    return path


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh project folder as the working directory (store and state land under it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Prefect stops its temporary server from an atexit hook, after pytest closed the captured
    streams; keep that last log line from printing a 'Logging error' traceback after the summary."""
    import logging

    logging.raiseExceptions = False
