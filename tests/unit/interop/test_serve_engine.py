"""``llmpipe serve`` without ``--engine`` serves a deploy artifact with the engine its deploy stage
recorded (``deploy.engine`` in ``deploy.json``), so a release checked under vLLM is served by vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmpipe.serving.layout import DEPLOY
from llmpipe.serving.server import deployed_engine
from tests.conftest import ROOT
from tests.unit.interop.conftest import deploy_artifact


@pytest.mark.parametrize("engine", ["triton", "vllm"])
def test_the_deploy_artifact_names_the_engine_it_was_checked_with(pretrain_dir: Path, tmp_path: Path,
                                                                   engine: str) -> None:
    assert deployed_engine(deploy_artifact(pretrain_dir, tmp_path / "deploy", engine)) == engine


def test_a_bare_repository_is_tritons_and_a_bad_record_is_named(tmp_path: Path) -> None:
    assert deployed_engine(tmp_path) == "triton"
    (tmp_path / DEPLOY.info).write_text(json.dumps({"engine": "tgi"}))
    with pytest.raises(ValueError, match=r"deploy\.json: engine 'tgi'"):
        deployed_engine(tmp_path)
    (tmp_path / DEPLOY.info).write_text("[1, 2")
    with pytest.raises(ValueError, match=r"deploy\.json: not a deploy\.json object"):
        deployed_engine(tmp_path)


def test_serve_without_engine_refuses_a_bad_record_naming_it(tmp_path: Path) -> None:
    (tmp_path / DEPLOY.info).write_text(json.dumps({"engine": "tgi"}))
    r = subprocess.run([sys.executable, "-m", "flows.cli", "serve", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "deploy.json: engine 'tgi'" in r.stderr
