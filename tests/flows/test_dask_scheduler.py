"""The curation stages on a separately started Dask cluster give the local executor's bytes (issue 30, item 7).

A ``dask scheduler`` and two ``dask worker`` processes run as subprocesses on 127.0.0.1 (random
ports), each worker with its own cwd, ``--local-directory`` and TMPDIR: the driver connects through
``executor.dask_address`` only, as it would to a cluster of machines. ingest -> ... -> dedup of
``configs/tiny.yaml`` runs once on the local process pool and once on that cluster, each into a
fresh store; every file of every artifact must be byte-identical, and the shard jobs must have run
on both workers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _files(store_root: Path) -> dict[str, str]:
    """``stage/<file>`` -> sha256 for every file of every published artifact (not the manifest:
    it holds timings), keyed without the artifact key so two stores compare file by file."""
    out: dict[str, str] = {}
    for manifest in sorted(store_root.glob("*/*/manifest.json")):
        art = manifest.parent
        for f in sorted(p for p in art.rglob("*") if p.is_file() and p != manifest):
            out[f"{art.parent.name}/{f.relative_to(art).as_posix()}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _run(store: Path, state: Path, *overrides: str) -> dict[str, str]:
    """Run the curation stages through dedup into ``store``; stage -> key of what ran."""
    from llmpipe.config import load_config
    from llmpipe.dag import run_pipeline

    cfg = load_config(ROOT / "configs" / "tiny.yaml",
                      overrides=[f"store={store}", f"state_dir={state}", *overrides])
    runs = run_pipeline(cfg, flow="data_refresh", until="dedup")
    assert all(r.ran for r in runs), [(r.stage, r.ran) for r in runs]
    return {r.stage: r.key for r in runs}


def _survivors(root: Path) -> list[str]:
    """Processes whose working folder is under ``root`` (the scheduler's and workers')."""
    out = []
    for p in psutil.process_iter(["pid", "cwd", "cmdline"]):
        cwd = p.info.get("cwd") or ""
        if cwd.startswith(str(root)):
            out.append(f"{p.info['pid']}: {' '.join(p.info.get('cmdline') or [])}")
    return out


def test_curation_on_separate_scheduler_matches_local(tmp_path: Path) -> None:
    from distributed import Client, get_task_stream

    from llmpipe.executor_dask import dask_processes

    state = tmp_path / "state"
    local_keys = _run(tmp_path / "local", state, "executor.kind=local", "executor.workers=2")
    cluster = tmp_path / "cluster"
    with dask_processes(cluster, n_workers=2) as address:
        with Client(address, set_as_default=False) as client:
            workers = client.scheduler_info(n_workers=-1)["workers"]
            assert len(workers) == 2 and all(w.startswith("tcp://127.0.0.1:") for w in workers)
            homes = client.run(lambda: str(Path.cwd()))
            assert sorted(homes.values()) == [str(cluster / "worker-0"), str(cluster / "worker-1")]
            with get_task_stream(client) as stream:
                dask_keys = _run(tmp_path / "dask", state, "executor.kind=dask",
                                 f"executor.dask_address={address}")
        ran_on = {t["worker"] for t in stream.data if str(t.get("key", "")).startswith("run_shard_job")}
        assert ran_on == set(workers), f"shard jobs ran on {ran_on}, the cluster has {set(workers)}"
    assert not _survivors(cluster), _survivors(cluster)
    assert dask_keys == local_keys and "dedup" in dask_keys
    local, dask = _files(tmp_path / "local"), _files(tmp_path / "dask")
    assert {f.split("/")[0] for f in local} == set(local_keys)
    assert list(dask) == list(local), set(dask) ^ set(local)
    differ = [f for f in local if dask[f] != local[f]]
    assert not differ, f"files that differ between the Dask cluster and the local executor: {differ}"
