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
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _files(store_root: Path, keys: dict[str, str] | None = None) -> dict[str, str]:
    """``stage/<file>`` -> sha256 for every file of every published artifact (not the manifest:
    it holds timings), keyed without the artifact key so two stores compare file by file;
    ``keys``: only the artifacts of these stage keys (a store holding other runs too)."""
    out: dict[str, str] = {}
    for manifest in sorted(store_root.glob("*/*/manifest.json")):
        art = manifest.parent
        if keys is not None and keys.get(art.parent.name) != art.name:
            continue
        for f in sorted(p for p in art.rglob("*") if p.is_file() and p != manifest):
            out[f"{art.parent.name}/{f.relative_to(art).as_posix()}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _planned(*overrides: str) -> dict[str, str]:
    """stage -> key of ingest .. dedup as ``configs/tiny.yaml`` plans them (no run)."""
    from llmpipe.config import load_config
    from llmpipe.dag import plan, select

    cfg = load_config(ROOT / "configs" / "tiny.yaml", overrides=list(overrides))
    return {ps.name: ps.key for ps in select(plan(cfg), "data_refresh", None, "dedup")}


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


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    """The reference: stage keys and artifact files of the local process pool, local store: those
    ``make run`` published in the repository's store where CI has them (the same keys), else a run."""
    from tests.conftest import make_run_store

    keys = _planned("executor.kind=local", "executor.workers=2")
    made = make_run_store(keys, "dask-scheduler")
    if made is not None:
        return keys, _files(made, keys)
    tmp = tmp_path_factory.mktemp("local")
    ran = _run(tmp / "store", tmp / "state", "executor.kind=local", "executor.workers=2")
    assert ran == keys, (ran, keys)
    return ran, _files(tmp / "store")


def test_curation_on_separate_scheduler_matches_local(tmp_path: Path, local_run) -> None:
    from distributed import Client, get_task_stream

    from llmpipe.executor_dask import dask_processes

    state = tmp_path / "state"
    local_keys, local = local_run
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
    dask = _files(tmp_path / "dask")
    assert {f.split("/")[0] for f in local} == set(local_keys)
    assert list(dask) == list(local), set(dask) ^ set(local)
    differ = [f for f in local if dask[f] != local[f]]
    assert not differ, f"files that differ between the Dask cluster and the local executor: {differ}"


@pytest.fixture
def s3_server(tmp_path: Path) -> Iterator[str]:
    """A real S3-compatible server (moto's ``moto_server``) on 127.0.0.1 with a bucket ``llmpipe``.

    s3fs finds it through fsspec's configuration from the environment (``FSSPEC_S3_ENDPOINT_URL``):
    set here for this process and inherited by the Dask processes started after it.
    """
    import fsspec.config

    from llmpipe.processes import ManagedProcess, free_port, wait_for_http

    pytest.importorskip("s3fs", reason="the [test] extra's s3fs")
    cli = Path(sys.executable).with_name("moto_server")
    if not cli.is_file():
        pytest.skip("moto_server (the [test] extra's moto[server]) is not installed")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    old_conf = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    try:
        with ManagedProcess([cli, "-H", "127.0.0.1", "-p", str(port)], tmp_path / "moto.log",
                            name="moto_server") as server:
            wait_for_http(f"{endpoint}/moto-api/data.json", timeout=60, proc=server)
            fsspec.filesystem("s3", skip_instance_cache=True).mkdir("llmpipe")
            yield "s3://llmpipe"
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if old_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = old_conf


def test_curation_with_s3_store_goes_through_the_url(tmp_path: Path, local_run, s3_server: str) -> None:
    """With ``store: s3://...`` the workers read inputs and write shards through the store's URL,
    each into its own cache, and the store ends up with the local executor's bytes."""
    import fsspec

    from llmpipe.executor_dask import dask_processes

    local_keys, local = local_run
    cluster = tmp_path / "cluster"
    with dask_processes(cluster, n_workers=2) as address:
        keys = _run(f"{s3_server}/store", tmp_path / "state", "executor.kind=dask",
                    f"executor.dask_address={address}")
    assert not _survivors(cluster), _survivors(cluster)
    assert keys == local_keys
    fs = fsspec.filesystem("s3")
    remote = {}
    for stage, key in keys.items():
        base = f"llmpipe/store/{stage}/{key}"
        for f in fs.find(base):
            if not f.endswith("/manifest.json"):
                remote[f"{stage}/{f[len(base) + 1:]}"] = hashlib.sha256(fs.cat_file(f)).hexdigest()
    assert sorted(remote) == sorted(local), set(remote) ^ set(local)
    differ = [f for f in local if remote[f] != local[f]]
    assert not differ, f"files in the S3 store that differ from the local executor's: {differ}"
    # the per-shard results went through the store, and each worker fetched its inputs into its own cache
    assert fs.glob("llmpipe/store/langid/_shards/*/_DONE.json")
    # the jobs' staging folders and the files the stages shared with them (coherence's model) are gone
    assert fs.find("llmpipe/store/coherence/_shards") and not [
        p for p in fs.find("llmpipe/store") if "/.tmp-" in p], "temporary folders left in the store"
    fetched: set[str] = set()
    for i in (0, 1):
        cache = cluster / f"worker-{i}" / ".llmpipe" / "store-cache"
        assert any(cache.glob("*/_shards/*/_DONE.json")), f"worker-{i} wrote no shard in its own cache"
        fetched |= {f.name for f in cache.glob("ingest/.shared-files/*/**/*") if f.is_file()}
    # ingest's source files went to the workers through the store too (not by the driver's paths)
    sources = {f.name for f in (tmp_path / "state").rglob("*.jsonl") if "builtin" in f.parts}
    assert sources and fetched == sources, (fetched, sources)
    # gc on the remote root: this run recorded itself there, so nothing it reached is collected; a
    # killed worker's upload is
    from llmpipe.store import ArtifactStore

    fs.pipe("llmpipe/store/langid/.tmp-job-killed/x.json", b"{}")
    store = ArtifactStore(f"{s3_server}/store", cache_dir=tmp_path / "gc-cache")
    assert [p for p, _ in store.gc(dry_run=False)] == [f"{s3_server}/store/langid/.tmp-job-killed"]
    assert all(fs.exists(f"llmpipe/store/{st}/{k}/manifest.json") for st, k in keys.items())
