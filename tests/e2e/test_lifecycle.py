"""The whole tiny lifecycle through the real CLI and Prefect: raw text to a Triton server answering.

(c) ``llmpipe run configs/tiny.yaml`` from ingest to deploy; every stage's artifact verifies, lineage
of the served model reaches the raw sources, and a Triton server started on the deployed repository
answers over HTTP and gRPC with what ``transformers`` generates. (d) The same command again: every
stage ``Cached``, no stage work done.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
STAGES = ["ingest", "langid", "quality", "safety", "dedup", "augment", "tokenizer", "tokenize", "pretrain",
          "evaluate", "quantize", "deploy"]


def _cli(tmp: Path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_API_URL": ""}
    env.pop("PREFECT_API_URL")
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", f"store={tmp / 'store'}",
           f"state_dir={tmp / 'state'}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _table(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in STAGES:
            rows[parts[0]] = parts
    return rows


def test_tiny_lifecycle_then_all_cached(tmp_path: Path) -> None:
    first = _cli(tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    table = _table(first.stdout)
    assert list(table) == STAGES, first.stdout
    assert all(r[2] == "ran" for r in table.values()), first.stdout

    from llmpipe.config import load_config
    from llmpipe.runner import open_store, plan

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"store={tmp_path / 'store'}",
                                                        f"state_dir={tmp_path / 'state'}"])
    planned = plan(cfg)
    store = open_store(cfg)
    arts = {name: store.get(name, ps.key) for name, ps in planned.items()}
    assert all(a is not None for a in arts.values()), [n for n, a in arts.items() if a is None]

    lineage = store.lineage("deploy", planned["deploy"].key)
    assert set(STAGES) <= {n["stage"] for n in lineage}
    assert "source:builtin" in {n["stage"] for n in lineage}
    assert not any(n.get("missing") for n in lineage)

    deploy = arts["deploy"]
    assert deploy.stats["verified"] is True
    assert {s["protocol"] for s in deploy.stats["smoke"] if s["ok"]} == {"http", "grpc"}
    _ask_triton(deploy.path)

    again = _cli(tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    rerun = _table(again.stdout)
    assert list(rerun) == STAGES
    assert all(r[2] == "cached" for r in rerun.values()), again.stdout
    assert all(r[3] == "Cached" for r in rerun.values()), again.stdout  # Prefect's state, not only the store's


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
