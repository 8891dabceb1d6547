"""The pipeline's own artifacts, for the tests that check what it exports against the ecosystem.

CI runs ``make run`` (``llmpipe run configs/tiny.yaml`` in the repository root, store ``.llmpipe/store``)
before ``make test``: these tests find its published tokenizer, pretrain and quantize artifacts by the
keys ``llmpipe.dag.plan`` computes for that config, as the lifecycle test does, and load exactly what a
user gets. A developer running the tests alone gets them from one ``llmpipe run configs/tiny.yaml
--until quantize`` per session (minutes), into the same store; the tests of this folder are then marked
``slow`` at collection, so ``-m "not slow"`` skips them instead of starting the run.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT

CONFIG = ROOT / "configs" / "tiny.yaml"
STAGES = ("tokenizer", "tokenize", "pretrain", "quantize")
HERE = Path(__file__).resolve().parent


@contextmanager
def _in_root() -> Iterator[None]:
    """The config's relative store and state folder are the repository root's, as ``make run`` saw them."""
    old = Path.cwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(old)


def published() -> dict[str, Path] | None:
    """Artifact folder of each of :data:`STAGES` that ``make run`` published for configs/tiny.yaml, or None
    when one is missing (or fails verification)."""
    from llmpipe.config import load_config
    from llmpipe.dag import open_store, plan

    with _in_root():
        cfg = load_config(CONFIG)
        planned = plan(cfg)
        store = open_store(cfg)
        arts = {name: store.get(name, planned[name].key) for name in STAGES}
    if any(a is None for a in arts.values()):
        return None
    return {name: Path(a.path).resolve() for name, a in arts.items()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this folder's tests slow when the artifacts are not published (they would start the run)."""
    mine = [i for i in items if HERE in Path(str(i.path)).parents]
    if mine and published() is None:
        for item in mine:
            item.add_marker(pytest.mark.slow)


def deploy_artifact(checkpoint: Path, out: Path, engine: str = "triton") -> Path:
    """The deploy stage's artifact around ``checkpoint`` (its own files; no server check of its own:
    the calling test is the check)."""
    import logging

    from llmpipe.serving.config import DeployConfig
    from llmpipe.serving.stage import run_deploy
    from llmpipe.stage import STAGES as STAGE_SPECS
    from llmpipe.stage import StageContext
    from llmpipe.store import ArtifactStore

    out.mkdir()
    run_deploy(StageContext(spec=STAGE_SPECS["deploy"], config=DeployConfig(verify=False, engine=engine), pipeline=None,
                            key="k", out=out, inputs={"quantize": checkpoint}, input_keys={"quantize": "q"},
                            store=ArtifactStore(out.parent / "store"), log=logging.getLogger("t")))
    return out


def end_of_document_prompts(tokenize_dir: Path, eos: int, n: int, width: int = 48) -> list[list[int]]:
    """The ``width`` tokens before each of the first ``n`` end-of-text tokens of held-out sequences."""
    from llmpipe.training.data import open_packed

    val, out = open_packed(tokenize_dir, "val"), []
    for i in range(len(val)):
        item = val[i]
        seq = (item[0] if isinstance(item, tuple) else item).tolist()
        out += [seq[p - width:p] for p, t in enumerate(seq) if t == eos and p >= width and eos not in seq[p - width:p]]
        if len(out) >= n:
            break
    return out[:n]


@pytest.fixture(scope="session")
def artifacts() -> dict[str, Path]:
    """The published artifacts of configs/tiny.yaml; produced by one pipeline run when missing."""
    found = published()
    if found is not None:
        return found
    lock_path = ROOT / ".llmpipe" / "interop-run.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:  # one run for concurrent test sessions of this checkout
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = published()
        if found is None:
            llmpipe = Path(sys.executable).parent / "llmpipe"  # the console script pip installed
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            run = subprocess.run([str(llmpipe), "run", str(CONFIG.relative_to(ROOT)), "--until", "quantize"],
                                 cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            found = published()
    assert found is not None, "llmpipe run configs/tiny.yaml finished but its artifacts are not in the store"
    return found


@pytest.fixture(scope="session")
def pretrain_dir(artifacts: dict[str, Path]) -> Path:
    """The pretrain artifact's ``save_pretrained`` folder (model and tokenizer)."""
    from llmpipe.evaluation.model_io import find_checkpoint

    return find_checkpoint(artifacts["pretrain"])


@pytest.fixture(scope="session")
def quantize_dir(artifacts: dict[str, Path]) -> Path:
    """The quantize artifact's checkpoint (compressed-tensors AWQ W4A16 for configs/tiny.yaml)."""
    from llmpipe.evaluation.model_io import find_checkpoint

    return find_checkpoint(artifacts["quantize"])
