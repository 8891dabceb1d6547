"""Optional extras per stage family: the table matches pyproject.toml, and a run checks them up front.

The curation-only tests run the real ``llmpipe`` command in a subprocess whose interpreter cannot
import the training and serving stack: a ``sitecustomize`` on ``PYTHONPATH`` puts a finder first on
``sys.meta_path`` that refuses those modules, so both ``import torch`` and ``find_spec("torch")`` fail
as they would in a venv holding only ``llmpipe[curation]``. A stage module that imported one of them
at module level, or a curation stage that needed one, fails the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from llmpipe.config import load_config
from llmpipe.pipeline import EXTRAS, MissingExtra, extra_of, load_stages, missing_extras
from tests.conftest import ROOT

LLMPIPE = Path(sys.executable).parent / "llmpipe"
# what a venv with only `pip install -e '.[curation]'` lacks (redis is there: Prefect depends on it)
# the stages `--until dedup` runs: every curation stage up to dedup, the quality dimensions (off) too
UNTIL_DEDUP = (lambda order: order[: order.index("dedup") + 1])(list(load_stages()))
NOT_IN_CURATION = ("torch", "transformers", "tokenizers", "accelerate", "safetensors", "deepspeed",
                   "llmcompressor", "compressed_tensors", "tritonclient", "distributed")

BLOCKER = '''\
"""Test harness: this interpreter cannot import the modules named in LLMPIPE_TEST_BLOCK."""
import os
import sys

BLOCKED = frozenset(filter(None, os.environ.get("LLMPIPE_TEST_BLOCK", "").split(",")))


class Blocker:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Blocker)
'''


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _requirement_names(reqs: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in reqs}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_module_of_the_table_comes_with_its_extra() -> None:
    """EXTRAS (what the check tests) and pyproject.toml (what pip installs) name the same packages."""
    project = _pyproject()
    optional = project["optional-dependencies"]
    dists_of = metadata.packages_distributions()
    core = _requirement_names(project["dependencies"])
    for extra, modules in EXTRAS.items():
        assert extra in optional, f"[{extra}] is in llmpipe.pipeline.EXTRAS but not in pyproject.toml"
        listed = _requirement_names(optional[extra])
        pulled = listed | {n for d in listed for n in _requirement_names(metadata.requires(d) or [])}
        for mod in modules:
            dists = {_norm(d) for d in dists_of.get(mod, [])}
            assert dists, f"{mod} ([{extra}]) is not installed here: run `make install-test`"
            assert dists & pulled, f"{mod}: none of {sorted(dists)} is installed by [{extra}] ({sorted(listed)})"
            assert not dists & core, f"{mod} is a core dependency: it needs no extra"
    assert set(_requirement_names(optional["all"])) == {"llmpipe"}
    all_extras = set(re.search(r"\[(.*)\]", optional["all"][0]).group(1).split(","))
    # [coherence] builds kenlm from source (a C++ compiler): [all] needs nothing but Python, and the
    # test install (`make test`, what CI runs) adds it
    assert all_extras == set(EXTRAS) - {"coherence"}, "[all] must name every stage family's extra but [coherence]"
    assert "coherence" in re.search(r"install-test:.*?pip install -qq -e '\.\[([a-z,]+)\]'",
                                    (ROOT / "Makefile").read_text(), re.S).group(1).split(",")


@pytest.mark.parametrize("overrides", [
    [],
    ["train.strategy=deepspeed", "dedup.backend=redis", "quantize.scheme=int8_dynamic", "executor.kind=dask"],
])
def test_every_stage_names_modules_of_known_extras(overrides: list[str]) -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides)
    for spec in load_stages().values():
        assert spec.extra is None or spec.extra in EXTRAS, spec.name
        for mod in spec.required_modules(cfg):
            extra_of(mod, [spec.extra])  # KeyError: a module no extra installs


def test_the_message_names_the_stage_the_extra_and_the_install_command() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["dedup.backend=redis"])
    dedup = load_stages()["dedup"]
    assert dedup.required_modules(cfg) == ("datasketch", "matplotlib", "redis")  # matplotlib: funnel.png
    err = MissingExtra({"stage 'dedup'": {"redis": ["redis"]}, "stage 'pretrain'": {"train": ["torch"]}})
    lines = str(err).splitlines()
    assert lines[0] == "stage 'dedup' needs the [redis] extra: pip install 'llmpipe[redis]' (not installed: redis)"
    assert lines[2] == "all of them: pip install 'llmpipe[redis,train]'"
    missing_extras([dedup], cfg)  # this venv has them all: no error


def _run_blocked(tmp_path: Path, args: list[str], blocked: tuple[str, ...] = NOT_IN_CURATION,
                 ) -> subprocess.CompletedProcess[str]:
    harness = tmp_path / "harness"
    harness.mkdir(exist_ok=True)
    (harness / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(harness), str(ROOT)]),
           "LLMPIPE_TEST_BLOCK": ",".join(blocked), "PREFECT_HOME": str(tmp_path / "prefect")}
    cmd = [str(LLMPIPE), "run", "configs/tiny.yaml", f"store={tmp_path / 'store'}",
           f"state_dir={tmp_path / 'state'}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_harness_blocks_imports_and_find_spec(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    code = ("import importlib.util, llmpipe.pipeline as p\n"
            "try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('imported')\n"
            "assert not p.importable('torch') and not p.importable('tritonclient') and p.importable('pyarrow')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
           "LLMPIPE_TEST_BLOCK": ",".join(NOT_IN_CURATION)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_lifecycle_without_the_train_stack_stops_before_any_work(tmp_path: Path) -> None:
    """Exit 2, one line per stage naming its extra, before a stage runs and before Prefect starts."""
    r = _run_blocked(tmp_path, [])
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "stage 'tokenizer' needs the [tokenize] extra: pip install 'llmpipe[tokenize]'" in out
    assert "stage 'pretrain' needs the [train] extra: pip install 'llmpipe[train]'" in out
    assert "stage 'quantize' needs the [train] and [quantize] extras: pip install 'llmpipe[train,quantize]'" in out
    assert "stage 'deploy' needs the [train] and [serve] extras" in out
    assert "all of them: pip install 'llmpipe[tokenize,train,quantize,serve]'" in out
    assert "stage 'dedup'" not in out  # what the curation extra holds is not reported
    assert not (tmp_path / "store").exists(), "a stage ran"
    assert not (tmp_path / "prefect").exists(), "Prefect started"


def test_a_redis_backend_needs_the_redis_extra(tmp_path: Path) -> None:
    r = _run_blocked(tmp_path, ["--until", "dedup", "dedup.backend=redis", "--no-prefect"],
                     blocked=(*NOT_IN_CURATION, "redis"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "stage 'dedup' needs the [redis] extra: pip install 'llmpipe[redis]'" in r.stderr
    assert not (tmp_path / "store").exists()


def test_curation_runs_without_the_train_and_serve_stack(tmp_path: Path) -> None:
    """``--until dedup`` checks only ingest..dedup, and none of them imports a blocked module."""
    r = _run_blocked(tmp_path, ["--until", "dedup", "--no-prefect", "executor.workers=1"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    ran = re.findall(r"^(\w+)\s+[0-9a-f]{12}\s+ran\b", r.stdout + r.stderr, re.M)
    assert ran == UNTIL_DEDUP, out


@pytest.mark.slow
def test_a_fresh_curation_only_venv_runs_curation_and_refuses_the_rest(tmp_path: Path) -> None:
    """The honest version of the tests above: a new venv with ``pip install -e '.[curation]'`` only.

    About 1.5-2 minutes on 2 cores (pip resolves from the registry; its wheel cache makes reruns
    faster), plus a run of ingest..dedup (without Prefect: the install is what is under test here).
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # --no-compile: pip would byte-compile every module of every package (most never imported here);
    # the run below compiles what it imports, as Python does
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "-e",
                          f"{ROOT}[curation]"],
                         capture_output=True, text=True, timeout=1200)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import importlib.util as u, sys; "
                            f"sys.exit(','.join(m for m in {NOT_IN_CURATION!r} if u.find_spec(m)) or None)"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, f"[curation] installed {probe.stderr.strip()}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PYTHONPATH", None)
    cmd = [str(venv / "bin" / "llmpipe"), "run", "configs/tiny.yaml", f"store={tmp_path / 'store'}",
           f"state_dir={tmp_path / 'state'}"]
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "stage 'pretrain' needs the [train] extra: pip install 'llmpipe[train]'" in refused.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "prefect").exists()
    curated = subprocess.run([*cmd, "--until", "dedup", "--no-prefect"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=900)
    assert curated.returncode == 0, curated.stdout + curated.stderr
    ran = re.findall(r"^(\w+)\s+[0-9a-f]{12}\s+ran\b", curated.stdout + curated.stderr, re.M)
    assert ran == UNTIL_DEDUP, curated.stdout + curated.stderr
