"""The whole tiny lifecycle as a new user runs it: raw text to a Triton server answering (smoke-tested over HTTP, gRPC and the OpenAI API).

The real ``llmpipe`` console script in a brand-new empty folder holding only a copy of the tiny config:
no server, no ``.llmpipe/``, no ``PREFECT_*`` variables (Prefect starts a temporary server). (c) From
ingest to deploy: exit 0, every stage ran, the terminal shows the stage lines and the table and no
traceback or warning; every stage's artifact verifies, the model's held-out bits per byte are at most
0.8x a unigram model's, lineage of the served model reaches the raw
sources, and a Triton server started on the deployed repository answers over HTTP and gRPC.
(d) The same command again: every stage ``Cached``, exit 0, as clean.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.e2e.conftest import ColdRun

pytestmark = pytest.mark.slow
STAGES = ["ingest", "langid", "quality", "coherence", "expertise", "safety", "entities", "dedup", "diversity", "timeliness",
          "augment", "tokenizer", "tokenize", "pretrain",
          "evaluate", "quantize", "deploy"]


def _cli(project: Path, *args: str, timeout: int = 1800,
         api_url: str | None = None) -> subprocess.CompletedProcess[str]:
    """``llmpipe run tiny.yaml`` in ``project``, as a user types it there (a copy of the tiny config).

    No ``PREFECT_*`` variable of ours reaches it: Prefect starts a temporary server for the run, unless
    ``api_url`` names a running server (as a user's ``PREFECT_API_URL`` would)."""
    project.mkdir(exist_ok=True)
    if not (project / "tiny.yaml").exists():
        shutil.copy(ROOT / "configs" / "tiny.yaml", project / "tiny.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    llmpipe = Path(sys.executable).parent / "llmpipe"  # the console script pip installed
    return subprocess.run([str(llmpipe), "run", "tiny.yaml", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _assert_clean(run: subprocess.CompletedProcess[str]) -> None:
    """Stage lines and the table only: no traceback, no warning, nothing on stderr."""
    for word in ("Traceback", "Warning", "WARNING", "warnings.warn"):
        assert word not in run.stdout, run.stdout
    assert run.stderr == "", run.stderr[-4000:]


def _table(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in STAGES:
            rows[parts[0]] = parts
    return rows


def test_tiny_lifecycle_in_a_fresh_folder_then_all_cached(cold_tiny_run: ColdRun, monkeypatch: pytest.MonkeyPatch) -> None:
    project, first = cold_tiny_run.project, cold_tiny_run.result  # the first run: `llmpipe run tiny.yaml`
    assert first.returncode == 0, first.stderr[-4000:] + _latest_logs(project)
    table = _table(first.stdout)
    assert list(table) == STAGES, first.stdout
    assert all(r[2] == "ran" for r in table.values()), first.stdout
    _assert_clean(first)
    assert (project / ".llmpipe" / "logs" / "latest" / "pretrain.log").is_file()

    from llmpipe.config import load_config
    from llmpipe.dag import open_store, plan

    monkeypatch.chdir(project)  # the config's relative store and state folder, as the CLI saw them
    cfg = load_config(project / "tiny.yaml")
    planned = plan(cfg)
    store = open_store(cfg)
    arts = {name: store.get(name, ps.key) for name, ps in planned.items()}
    assert all(a is not None for a in arts.values()), [n for n, a in arts.items() if a is None]

    # the default run teaches the model something: well under a unigram model of the training tokens
    evaluation = json.loads((Path(arts["evaluate"].path) / "results.json").read_text())
    model, unigram = evaluation["metrics"]["overall"], evaluation["baseline"]["overall"]
    assert model["bytes"] == unigram["bytes"] > 10_000
    assert model["bits_per_byte"] <= 0.8 * unigram["bits_per_byte"], (model, unigram)

    lineage = store.lineage("deploy", planned["deploy"].key)
    assert set(STAGES) <= {n["stage"] for n in lineage}
    assert "source:builtin" in {n["stage"] for n in lineage}
    assert not any(n.get("missing") for n in lineage)

    deploy = arts["deploy"]
    assert deploy.stats["verified"] is True
    assert {s["protocol"] for s in deploy.stats["smoke"] if s["ok"]} == {"http", "grpc", "openai"}
    _ask_triton(deploy.path)

    again = _cli(project)
    assert again.returncode == 0, again.stderr[-4000:]
    _assert_clean(again)
    rerun = _table(again.stdout)
    assert list(rerun) == STAGES
    assert all(r[2] == "cached" for r in rerun.values()), again.stdout
    assert all(r[3] == "Cached" for r in rerun.values()), again.stdout  # Prefect's state, not only the store's


def _latest_logs(project: Path) -> str:
    logs = project / ".llmpipe" / "logs" / "latest"
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("*.log")))


def _ask_triton(deploy_dir: Path) -> None:
    from llmpipe.serving import server
    from llmpipe.serving.client import TextClient

    if not server.available():
        pytest.skip("nvidia-pytriton's tritonserver is not installed (scripts/install.sh installs it)")
    with server.serve(deploy_dir) as srv:
        model = next(p.parent.name for p in srv.repo.glob("*/config.pbtxt"))
        for protocol, url in (("http", srv.http_url), ("grpc", srv.grpc_url)):
            with TextClient(url, model, protocol=protocol) as client:
                out = client.generate(prompt="The river", max_tokens=4, temperature=0.0)
                assert len(out.output_ids) >= 1 and isinstance(out.text, str)
