"""Shared fixtures: every test gets its own store, state folder and Prefect home (never ~/.prefect)."""

from __future__ import annotations

import datetime as dt
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE = ("llmpipe", "flows", "tasks", "configs", "pyproject.toml")  # what the bytes of a run depend on
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


def run_records(store: Path) -> list[dict[str, str]]:
    """The stage -> key maps of the runs recorded in ``store``, oldest first."""
    from llmpipe.store import RUNS

    return [json.loads(f.read_text())["artifacts"] for f in sorted((store / RUNS).glob("*.json"))]


def _newest_code() -> float:
    """When the code or a config last changed (the newest modification time of its files)."""
    files = [f for part in CODE for f in ([ROOT / part] if (ROOT / part).is_file() else (ROOT / part).rglob("*"))
             if f.is_file() and "__pycache__" not in f.parts]
    return max(f.stat().st_mtime for f in files)


def make_run_store(keys: dict[str, str], who: str) -> Path | None:
    """The repository's store when ``make run`` (CI runs it before the tests) published every artifact of
    ``keys`` there, under one recorded run, each made after the code last changed (an older one may be
    another version's bytes): a test that needs a cold run of those keys in a store of its own takes
    that one instead of paying its own. Otherwise None, and ``who`` says why in the warnings summary."""
    from llmpipe.store import ArtifactStore

    store_dir = ROOT / ".llmpipe" / "store"
    if not store_dir.is_dir() or not any(keys.items() <= run.items() for run in run_records(store_dir)):
        return _not_taken(who, f"no run of these keys is recorded in {store_dir}")
    store, newest = ArtifactStore(store_dir), _newest_code()
    for name, key in keys.items():
        art = store.get(name, key)
        if art is None or dt.datetime.fromisoformat(art.manifest["created"]).timestamp() <= newest:
            return _not_taken(who, f"{name} {key[:12]} is {'absent' if art is None else 'older than the code'}")
    return store_dir


def link_artifacts(src: Path, dest: Path, keys: dict[str, str]) -> None:
    """Hard-link the artifact of each of ``keys`` from store ``src`` into store ``dest`` (a setup that
    needs them published, not made by itself: the stages after them then run on them). Publishing
    renames a new folder into place and nothing writes into a published artifact, so ``src``'s files
    stay as they are; the store hashes the linked files on first use (no stamps come along)."""
    import shutil

    for stage, key in keys.items():
        shutil.copytree(src / stage / key, dest / stage / key, copy_function=os.link)


def _not_taken(who: str, why: str) -> None:
    """Say in the suite's warnings summary why ``make run``'s store was not used (the test then pays a
    cold run of its own): where the time went is then in CI's log."""
    warnings.warn(f"{who}: make run's store not used: {why}", stacklevel=3)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh project folder as the working directory (store and state land under it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """ONE real Prefect server for the session (``prefect server start``, as ``llmpipe server`` runs it):
    every flow run of a test that asks for it, in this process or in a subprocess, talks to it.

    Without it each ``llmpipe run`` (and this process's first flow) starts Prefect's temporary server:
    a no-change tiny rerun is ~37 s with one and ~6 s with a server up. The server listens on a free
    port of 127.0.0.1, keeps its SQLite database and home in a tmp folder, and is a ManagedProcess (its
    own process group, stopped whole at session end; spawn() hands it to the watchdog, which ends it if
    pytest is killed).
    ``PREFECT_API_URL`` goes into ``os.environ`` (subprocesses inherit it) and into this process's
    Prefect settings (read when Prefect was imported, so ``temporary_settings``). A run WITHOUT a
    server is still tested: the shared cold lifecycle run (tests/e2e/test_lifecycle.py), the killed
    temporary-server run (tests/e2e/test_no_survivors.py), and ``make run`` in CI."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import prefect_ops
    from llmpipe.processes import free_port

    root = tmp_path_factory.mktemp("prefect-session")
    port = free_port()
    server = prefect_ops.start_server(root / "state", port=port, log_path=root / "server.log", timeout=240,
                                      extra_env={"PREFECT_HOME": str(root / "home"),
                                                 "PREFECT_API_DATABASE_CONNECTION_URL":
                                                     f"sqlite+aiosqlite:///{root / 'prefect.db'}"})
    url = f"http://127.0.0.1:{port}/api"
    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old
        server.stop(grace=10)
        assert not server.leftovers(), f"the session's Prefect server left processes: {server.leftovers()}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Prefect stops its temporary server from an atexit hook, after pytest closed the captured
    streams; keep that last log line from printing a 'Logging error' traceback after the summary."""
    import logging

    logging.raiseExceptions = False
