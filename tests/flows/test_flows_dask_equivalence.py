"""The data_refresh flow on a Dask LocalCluster (2 worker processes on 127.0.0.1) produces the same
artifact keys and the same bytes as the local process-pool run (issue 9, item 1)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _artifacts(store_root: Path) -> dict[str, dict[str, Any]]:
    """stage -> {key, files: {path: (sha256, bytes)}} for every published artifact in a store."""
    out: dict[str, dict[str, Any]] = {}
    for manifest in sorted(store_root.glob("*/*/manifest.json")):
        m = json.loads(manifest.read_text())
        files = {p: (f["sha256"], f["bytes"]) for p, f in m["files"].items()}
        assert m["stage"] not in out, f"two artifacts for {m['stage']} in one fresh store"
        out[m["stage"]] = {"key": m["key"], "files": files, "inputs": m.get("inputs")}
    return out


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory: pytest.TempPathFactory):
    old = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    yield
    if old is None:
        os.environ.pop("PREFECT_HOME", None)
    else:
        os.environ["PREFECT_HOME"] = old


def test_data_refresh_on_dask_matches_local(tmp_path: Path, prefect_home: None) -> None:
    from flows.data_refresh import data_refresh
    from llmpipe.executor_dask import _CLUSTERS, close_local_clusters

    config = str(ROOT / "configs" / "tiny.yaml")
    common = [f"state_dir={tmp_path / 'state'}"]
    try:
        local_rows = data_refresh(config=config, overrides=[*common, f"store={tmp_path / 'local'}",
                                                            "executor.kind=local", "executor.workers=2"])
        dask_rows = data_refresh(config=config, overrides=[*common, f"store={tmp_path / 'dask'}",
                                                           "executor.kind=dask", "executor.dask_workers=2"])
        assert _CLUSTERS, "executor.kind=dask did not start a LocalCluster"
        (cluster,) = _CLUSTERS.values()
        assert len(cluster.workers) == 2 and cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    finally:
        close_local_clusters()
    assert [r["status"] for r in dask_rows] == ["ran"] * len(dask_rows), dask_rows
    assert [(r["stage"], r["key"]) for r in local_rows] == [(r["stage"], r["key"]) for r in dask_rows]
    local, dask = _artifacts(tmp_path / "local"), _artifacts(tmp_path / "dask")
    assert list(local) == list(dask) and len(local) == len(local_rows)
    for stage in local:
        assert dask[stage] == local[stage], f"{stage}: Dask artifact differs from the local one"
