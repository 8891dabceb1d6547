"""``llmpipe lr-find`` as a user runs it: after `--until tokenize`, a suggestion, a curve, an untouched store.

The store is the shared cold run's (``cold_tiny_run``), hard-linked into a fresh project: its
``--until tokenize`` is then all reuse, and the suite pays one cold run instead of two.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import ColdRun
from tests.e2e.test_lifecycle import _cli

pytestmark = pytest.mark.slow


def test_lr_find_suggests_a_rate_and_draws_the_curve_without_touching_the_store(tmp_path: Path,
                                                                                cold_tiny_run: ColdRun) -> None:
    import os
    import shutil
    import subprocess
    import sys

    from tests.conftest import ROOT

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(ROOT / "configs" / "tiny.yaml", project / "tiny.yaml")
    llmpipe = Path(sys.executable).parent / "llmpipe"
    early = subprocess.run([str(llmpipe), "lr-find", "tiny.yaml"], cwd=project, capture_output=True, text=True,
                           timeout=300)
    assert early.returncode == 1 and "run `llmpipe run tiny.yaml --until tokenize` first" in early.stderr, \
        early.stderr
    assert cold_tiny_run.result.returncode == 0, f"the shared cold run failed:\n{cold_tiny_run.result.stderr[-4000:]}"
    store = project / ".llmpipe" / "store"
    shutil.copytree(cold_tiny_run.project / ".llmpipe" / "store", store, copy_function=os.link, dirs_exist_ok=True)
    assert _cli(project, "--until", "tokenize", "--no-prefect").returncode == 0
    before = sorted(p.relative_to(store).as_posix() for p in store.rglob("*"))
    r = subprocess.run([str(llmpipe), "lr-find", "tiny.yaml", "--steps", "40", "--max-lr", "3"], cwd=project,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "suggested learning rate: " in r.stdout and "train.optimizer.lr=" in r.stdout, r.stdout
    (out,) = (project / ".llmpipe" / "lr-find").iterdir()
    result = json.loads((out / "lr_find.json").read_text())
    assert 1e-5 <= result["suggested_lr"] <= 3 and len(result["lrs"]) == len(result["losses"]) >= 5
    assert (out / "lr_find.png").stat().st_size > 1000
    assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*")) == before
