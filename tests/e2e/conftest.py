"""A real Prefect server and process worker for end-to-end tests, with state in a temporary folder.

The server is the session's one (``prefect_api`` in tests/conftest.py: a free port of 127.0.0.1, its
SQLite database in a tmp dir); the worker polls the ``llmpipe-process`` pool. Teardown stops the
worker by PID (a background worker ignores the first SIGTERM: ManagedProcess sends a second, then
SIGKILLs the process group and every descendant) and fails the test if any of its processes is left
running; the session stops the server the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flows import prefect_ops
from llmpipe.processes import ManagedProcess

OUTPUTS = Path(__file__).resolve().parent / "_outputs"  # git-ignored: screenshots, server/worker logs


@dataclass
class PrefectStack:
    root: Path
    state_dir: Path
    api_url: str
    ui_url: str
    env: dict[str, str]
    workers: list[ManagedProcess] = field(default_factory=list)

    def deploy(self, prefect_file: str | Path = prefect_ops.PREFECT_FILE, **kw: Any) -> list[str]:
        return prefect_ops.deploy(prefect_file, state_dir=self.state_dir, api_url=self.api_url, **kw)

    def start_worker(self, pool: str = prefect_ops.WORK_POOL) -> ManagedProcess:
        w = prefect_ops.start_worker(pool, state_dir=self.state_dir, api_url=self.api_url, extra_env=self.env,
                             log_path=self.root / f"worker-{len(self.workers)}.log")
        self.workers.append(w)
        return w

    def trigger(self, name: str, parameters: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        return prefect_ops.trigger(name, parameters, timeout=timeout, state_dir=self.state_dir, api_url=self.api_url)

    def wait(self, flow_run_id: Any, timeout: float = 600) -> Any:
        return prefect_ops.wait_for_flow_run(flow_run_id, timeout=timeout, state_dir=self.state_dir, api_url=self.api_url)

    def deployments(self) -> dict[str, Any]:
        return prefect_ops.list_deployments(state_dir=self.state_dir, api_url=self.api_url)

    def cli_env(self) -> dict[str, str]:
        """Environment for running ``prefect ...`` against this server from a test."""
        return prefect_ops.prefect_env(self.state_dir, self.api_url, self.env)

    def logs(self) -> str:
        parts = [f"--- {p.name} ({p.log_path})\n{p.tail(80)}" for p in self.workers]
        return "\n".join(parts)


def _save_logs(stack: PrefectStack, label: str) -> None:
    dest = OUTPUTS / label
    dest.mkdir(parents=True, exist_ok=True)
    for p in stack.workers:
        if p.log_path.exists():
            shutil.copy(p.log_path, dest / p.log_path.name)


def run_tiny_chat(until: str | None = None) -> tuple[Any, list[Any]]:
    """(config, stage runs) of ``configs/tiny-chat.yaml`` run in the repository root (``until``: its
    last stage), so its store is the one ``make run`` fills and tiny.yaml's artifacts are reused."""
    from llmpipe.config import load_config
    from llmpipe.dag import run_pipeline
    from tests.conftest import ROOT

    old = Path.cwd()
    os.chdir(ROOT)  # the config's relative store is the repository root's, as `make run` saw it
    try:
        cfg = load_config(ROOT / "configs" / "tiny-chat.yaml")
        return cfg, run_pipeline(cfg, until=until)
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def prefect_stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  prefect_api: str) -> Iterator[PrefectStack]:
    """The session's server + one process worker of this module (a server of its own took ~20-30 s
    to start here; the tests check their own deployments and runs, never that nothing else is there)."""
    root = tmp_path_factory.mktemp("prefect-e2e")
    state_dir = root / "state"
    env = {
        "PREFECT_HOME": str(root / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
    }
    stack = PrefectStack(root=root, state_dir=state_dir, api_url=prefect_api,
                         ui_url=prefect_api.removesuffix("/api"), env=env)
    old_home = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = env["PREFECT_HOME"]  # this process's client profile stays in tmp too
    try:
        stack.start_worker()
        yield stack
    finally:
        procs = stack.workers
        for p in procs:
            p.stop(grace=10)
        _save_logs(stack, request.module.__name__.rsplit(".", 1)[-1])
        if old_home is None:
            os.environ.pop("PREFECT_HOME", None)
        else:
            os.environ["PREFECT_HOME"] = old_home
        leaked = {p.name: p.leftovers() for p in procs if p.leftovers()}
        assert not leaked, f"processes left running after teardown: {leaked}"


@dataclass
class ColdRun:
    """A finished first ``llmpipe run tiny.yaml`` in a brand-new folder (its store: ``.llmpipe/store``)."""

    project: Path
    result: subprocess.CompletedProcess[str]


@pytest.fixture(scope="session")
def cold_tiny_run(tmp_path_factory: pytest.TempPathFactory) -> ColdRun:
    """One cold tiny lifecycle, shared: the lifecycle test checks it as a new user's first run, the
    same-bytes test compares its published bytes with another cold run's (a cold run is minutes on 2
    cores; each test did its own before). Nothing of it is checked here: a failed run fails both tests."""
    from tests.e2e.test_lifecycle import _cli

    project = tmp_path_factory.mktemp("cold-tiny") / "project"
    return ColdRun(project, _cli(project))
