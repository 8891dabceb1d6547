"""The data_refresh flow on a Dask LocalCluster (2 worker processes on 127.0.0.1) produces the same
artifact keys and the same bytes as the local process-pool run (issue 9, item 1).

The local run is ``make run``'s (tiny.yaml on the local executor, the repository's store) when that
store holds every artifact of the Dask run's keys and is current (CI runs it before the tests);
otherwise the test runs data_refresh locally into a fresh store of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import make_run_store

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _artifact(manifest: Path) -> dict[str, Any]:
    m = json.loads(manifest.read_text())
    return {"key": m["key"], "files": {p: (f["sha256"], f["bytes"]) for p, f in m["files"].items()},
            "inputs": m.get("inputs"), "stage": m["stage"]}


def _artifacts(store_root: Path) -> dict[str, dict[str, Any]]:
    """stage -> {key, files: {path: (sha256, bytes)}} for every published artifact in a store."""
    out: dict[str, dict[str, Any]] = {}
    for manifest in sorted(store_root.glob("*/*/manifest.json")):
        art = _artifact(manifest)
        assert art["stage"] not in out, f"two artifacts for {art['stage']} in one fresh store"
        out[art["stage"]] = art
    return out


def _keyed(store_root: Path, keys: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The same for the artifact of each of ``keys`` (a store that holds others too)."""
    return {stage: _artifact(store_root / stage / key / "manifest.json") for stage, key in sorted(keys.items())}


def _data_refresh_keys(config: str, overrides: list[str]) -> dict[str, str]:
    """stage -> full key of the data_refresh stages (the flow's rows show 12 characters)."""
    from llmpipe.config import load_config
    from llmpipe.dag import plan, select

    return {ps.name: ps.key for ps in select(plan(load_config(config, overrides)), "data_refresh", None, None)}


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory: pytest.TempPathFactory):
    old = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    yield
    if old is None:
        os.environ.pop("PREFECT_HOME", None)
    else:
        os.environ["PREFECT_HOME"] = old


def test_data_refresh_on_dask_matches_local(tmp_path: Path, prefect_home: None, prefect_api: str) -> None:
    from flows.data_refresh import data_refresh
    from llmpipe.executor_dask import _CLUSTERS, close_local_clusters

    config = str(ROOT / "configs" / "tiny.yaml")
    common = [f"state_dir={tmp_path / 'state'}"]
    try:
        dask_rows = data_refresh(config=config, overrides=[*common, f"store={tmp_path / 'dask'}",
                                                           "executor.kind=dask", "executor.dask_workers=2"])
        assert _CLUSTERS, "executor.kind=dask did not start a LocalCluster"
        (cluster,) = _CLUSTERS.values()
        assert len(cluster.workers) == 2 and cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    finally:
        close_local_clusters()
    keys = _data_refresh_keys(config, [*common, "executor.kind=dask", "executor.dask_workers=2"])
    assert [(r["stage"], r["key"]) for r in dask_rows] == [(s, k[:12]) for s, k in keys.items()], dask_rows
    made = make_run_store(keys, "dask-equivalence")  # its record holds the same keys: they are the local ones
    if made is None:
        local_rows = data_refresh(config=config, overrides=[*common, f"store={tmp_path / 'local'}",
                                                            "executor.kind=local", "executor.workers=2"])
        assert [(r["stage"], r["key"]) for r in local_rows] == [(r["stage"], r["key"]) for r in dask_rows]
        local = _artifacts(tmp_path / "local")
    else:
        local = _keyed(made, keys)
    assert [r["status"] for r in dask_rows] == ["ran"] * len(dask_rows), dask_rows
    dask = _artifacts(tmp_path / "dask")
    assert list(local) == list(dask) and len(local) == len(dask_rows)
    for stage in local:
        assert dask[stage] == local[stage], f"{stage}: Dask artifact differs from the local one"
