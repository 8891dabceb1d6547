"""Same key, same bytes: two cold runs of the tiny lifecycle on two fresh stores publish identical artifacts.

Each run is its own ``llmpipe run configs/tiny.yaml --no-prefect`` process (Prefect writes no
artifact files, and without it the runs are faster), with its own store and state folder and a
different ``PYTHONHASHSEED``, so anything that depends on set or dict-of-str order, on the clock or
on a process's history shows up as a difference. For every stage the keys must match, every file of
both artifacts must match byte for byte, each artifact must hold exactly the files its manifest
lists, and the manifests must be equal except their stats and timestamps (measurements of the run).
Then a Triton server serves one published deploy artifact, and the artifact must be unchanged:
nothing writes into a published artifact.

The two runs go at the same time, on a short training run and a small calibration set (bytes do not
depend on how long the model trains): every stage still runs, and a few minutes on 2 cores.
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

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
MEASURED = ("stats", "timings", "created")  # the manifest's record of this run: may differ
SHORT = ["train.max_steps=20", "train.schedule.warmup_steps=2", "train.checkpoint.every=10",
         "quantize.calibration.samples=8"]


def _run_both(roots: list[Path]) -> None:
    """One cold lifecycle per root, both at once: they run the same code even while the tree is being
    edited, and a machine with more than 2 cores finishes in the time of one."""
    procs = []
    for seed, root in enumerate(roots, 1):
        root.mkdir(parents=True)
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"store={root / 'store'}",
               f"state_dir={root / 'state'}", "--no-prefect", *SHORT]
        with open(root / "run.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:  # a timeout or Ctrl-C: the run, its training workers and its server go
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for root, code in zip(roots, codes, strict=True):
        tail = (root / "run.log").read_text(errors="replace")[-4000:]
        assert code == 0, f"the run in {root} failed with exit code {code}:\n{tail}"


def _artifacts(root: Path) -> dict[str, Any]:
    """stage -> its verified artifact, for the stages the one run recorded in the store under ``root``."""
    from llmpipe.store import RUNS, ArtifactStore

    store = ArtifactStore(root / "store")
    records = sorted((root / "store" / RUNS).glob("*.json"))
    assert len(records) == 1, f"{root}: expected the record of one run, found {len(records)}"
    keys = json.loads(records[0].read_text())["artifacts"]
    arts = {name: store.get(name, key) for name, key in keys.items()}
    missing = [name for name, art in arts.items() if art is None]
    assert not missing, f"{root}: no verified artifact for stages {missing}"
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


def test_two_cold_runs_publish_the_same_bytes(tmp_path: Path) -> None:
    _run_both([tmp_path / "a", tmp_path / "b"])
    arts_a, arts_b = _artifacts(tmp_path / "a"), _artifacts(tmp_path / "b")
    assert list(arts_a) == list(arts_b)
    problems = [p for stage in arts_a for p in _compare(stage, arts_a[stage], arts_b[stage])]
    assert not problems, "the same keys published different bytes:\n" + "\n".join(problems)

    from llmpipe.serving import server

    if not server.available():  # deploy skipped its server check too; the comparison above still holds
        return
    _serve_once(arts_a["deploy"].path)
    after = _artifacts(tmp_path / "a")["deploy"]
    problems = _compare("deploy", after, arts_b["deploy"])
    assert not problems, "serving the published deploy artifact changed it:\n" + "\n".join(problems)
