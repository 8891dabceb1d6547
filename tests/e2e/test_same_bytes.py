"""Same key, same bytes: two cold runs of the tiny lifecycle on two fresh stores publish identical artifacts.

Run A is the lifecycle test's cold run (``llmpipe run tiny.yaml`` in a brand-new folder, shared through
the session fixture ``cold_tiny_run``). Run B is another cold run of the same config in another
folder: the one ``make run`` published in the repository's ``.llmpipe/store`` (CI runs it before the
tests), when that store holds every artifact of A's keys under one recorded run and each was made after
the last change to the code and configs; otherwise this test's own ``llmpipe run configs/tiny.yaml``
into a temporary store. Each run is its own process with its own store and state folder
and its own ``PYTHONHASHSEED`` (B's own run sets 2; the others draw theirs at random, as Python does),
so anything that depends on set or dict-of-str order, on the clock or on a process's history shows up
as a difference. For every stage the keys must match, every file of both artifacts must match byte for
byte, each artifact must hold exactly the files its manifest lists, and the manifests must be equal
except their stats and timestamps (measurements of the run). Then a Triton server serves A's published
deploy artifact, and the artifact must be unchanged: nothing writes into a published artifact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, make_run_store, run_records
from tests.e2e.conftest import ColdRun

pytestmark = pytest.mark.slow
# the manifest's record of this run, which may differ: its figures, and the per-shard results it reused
# (a refresh that links the previous artifact's decisions reuses none; a cold run lists its own)
MEASURED = ("stats", "timings", "created", "shard_cache")


def _own_run(root: Path) -> Path:
    """A cold lifecycle into a fresh store under ``root``, through Prefect's temporary server as run A
    went (a ``--no-prefect`` run lists other per-shard cache keys in its ingest and quality manifests)."""
    root.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONHASHSEED="2", HF_HUB_OFFLINE="1", PREFECT_HOME=str(root / "prefect-home"))
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"store={root / 'store'}",
           f"state_dir={root / 'state'}"]
    with open(root / "run.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=1800)
    finally:  # a timeout or Ctrl-C: the run, its training workers and its server go
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail = (root / "run.log").read_text(errors="replace")[-4000:]
    assert code == 0, f"the run in {root} failed with exit code {code}:\n{tail}"
    return root / "store"


def _artifacts(store_dir: Path, keys: dict[str, str]) -> dict[str, Any]:
    """stage -> its verified artifact of ``keys`` in ``store_dir``."""
    from llmpipe.store import ArtifactStore

    store = ArtifactStore(store_dir)
    arts = {name: store.get(name, key) for name, key in keys.items()}
    missing = [name for name, art in arts.items() if art is None]
    assert not missing, f"{store_dir}: no verified artifact for stages {missing}"
    return arts


def _on_disk(path: Path) -> set[str]:
    return {f.relative_to(path).as_posix() for f in path.rglob("*") if not f.is_dir()} - {"manifest.json"}


def _first_difference(a: bytes, b: bytes) -> str:
    """Where two versions of a file part: the byte offset, and for text the first differing lines."""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    out = f"{len(a)} vs {len(b)} bytes, first difference at byte {at}"
    try:
        la, lb = a.decode("utf-8").splitlines(), b.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return out
    n = next((i for i, (x, y) in enumerate(zip(la, lb, strict=False)) if x != y), min(len(la), len(lb)))
    line_a, line_b = (la[n] if n < len(la) else "<end>"), (lb[n] if n < len(lb) else "<end>")
    return f"{out}, line {n + 1}:\n  run A: {line_a[:300]}\n  run B: {line_b[:300]}"


def _compare(stage: str, a: Any, b: Any) -> list[str]:
    """Every way the artifacts of one stage from the two runs differ, each naming the stage and file."""
    problems = []
    if a.key != b.key:
        return [f"stage {stage!r}: keys differ ({a.key[:12]} vs {b.key[:12]})"]
    for label, art in (("A", a), ("B", b)):
        extra = _on_disk(art.path) - set(art.manifest["files"])
        if extra:
            problems.append(f"stage {stage!r}: run {label} has files its manifest does not list "
                            f"(written after publishing?): {sorted(extra)}")
        cached = [f for f in art.manifest["files"] if "__pycache__" in f or f.endswith(".pyc")]
        if cached:
            problems.append(f"stage {stage!r}: run {label} published bytecode: {cached}")
    files_a, files_b = _on_disk(a.path), _on_disk(b.path)
    for f in sorted(files_a ^ files_b):
        problems.append(f"stage {stage!r}: file {f!r} only in run {'A' if f in files_a else 'B'}")
    for f in sorted(files_a & files_b):
        da, db = (a.path / f).read_bytes(), (b.path / f).read_bytes()
        if da != db:
            problems.append(f"stage {stage!r}: file {f!r} differs: {_first_difference(da, db)}")
    ma, mb = ({k: v for k, v in m.manifest.items() if k not in MEASURED} for m in (a, b))
    if ma["files"] != mb["files"]:
        changed = sorted(k for k in set(ma["files"]) | set(mb["files"]) if ma["files"].get(k) != mb["files"].get(k))
        problems.append(f"stage {stage!r}: manifest.json 'files' differ for {changed}")
    for k in sorted(set(ma) | set(mb)):
        if k != "files" and ma.get(k) != mb.get(k):
            problems.append(f"stage {stage!r}: manifest.json {k!r} differs: {json.dumps(ma.get(k))[:300]} vs "
                            f"{json.dumps(mb.get(k))[:300]}")
    return problems


def _serve_once(deploy_dir: Path) -> None:
    """Start Triton on a published deploy artifact and get one answer (the Python backend imports model.py)."""
    from llmpipe.serving import server
    from llmpipe.serving.client import TextClient

    info = json.loads((deploy_dir / "deploy.json").read_text())
    with server.serve(deploy_dir, startup_timeout_s=300) as srv:
        with TextClient(srv.http_url, info["model"], "http") as c:
            assert c.generate(prompt="The ", max_tokens=2).output_ids


def test_two_cold_runs_publish_the_same_bytes(cold_tiny_run: ColdRun, tmp_path: Path) -> None:
    first = cold_tiny_run.result
    assert first.returncode == 0, f"the shared cold run failed:\n{first.stderr[-4000:]}"
    store_a = cold_tiny_run.project / ".llmpipe" / "store"
    keys = run_records(store_a)[0]  # its first record is the cold run's (the lifecycle test adds a cached one)
    store_b = make_run_store(keys, "same-bytes") or _own_run(tmp_path / "b")
    assert any(keys.items() <= run.items() for run in run_records(store_b)), \
        f"the two runs computed different keys:\nA {keys}\nB {run_records(store_b)}"
    arts_a, arts_b = _artifacts(store_a, keys), _artifacts(store_b, keys)
    problems = [p for stage in arts_a for p in _compare(stage, arts_a[stage], arts_b[stage])]
    assert not problems, "the same keys published different bytes:\n" + "\n".join(problems)

    from llmpipe.serving import server

    if not server.available():  # deploy skipped its server check too; the comparison above still holds
        return
    _serve_once(arts_a["deploy"].path)
    after = _artifacts(store_a, {"deploy": keys["deploy"]})["deploy"]
    problems = _compare("deploy", after, arts_b["deploy"])
    assert not problems, "serving the published deploy artifact changed it:\n" + "\n".join(problems)
