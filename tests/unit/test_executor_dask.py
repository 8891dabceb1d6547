"""DaskExecutor against a real 2-worker LocalCluster on 127.0.0.1: order, parallelism, cached_map bytes."""

from __future__ import annotations

import hashlib
import math
import os
import types
from pathlib import Path

import pytest

from llmpipe.executor import LocalExecutor
from llmpipe.executor_dask import DaskExecutor, close_local_clusters, executor_from_config
from llmpipe.stage import StageContext, StageSpec


@pytest.fixture(scope="module")
def dask_executor():
    executor = DaskExecutor(n_workers=2)
    yield executor
    executor.close()
    close_local_clusters()


def _slow_pid(_: int) -> int:
    import time

    time.sleep(0.3)
    return os.getpid()


def test_map_keeps_order_and_uses_worker_processes(dask_executor: DaskExecutor) -> None:
    assert dask_executor.map(math.factorial, range(12)) == [math.factorial(i) for i in range(12)]
    assert dask_executor.map(math.factorial, []) == []
    pids = set(dask_executor.map(_slow_pid, range(8)))
    assert os.getpid() not in pids
    assert len(pids) == 2, f"expected both worker processes to take shards, got {pids}"
    assert dask_executor.workers == 2


def _write_shard(arg: tuple[str, int], out: Path) -> dict:
    name, n = arg
    text = "".join(f"{name}-{i}\n" for i in range(n))
    (out / f"{name}.txt").write_text(text)
    return {"docs": n}


class _ShardStore:
    """Only the piece of the artifact store that ``cached_map`` uses: where shard results live."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def shard_cache_root(self, stage: str) -> Path:
        return self.root / stage / "_shards"


def _ctx(tmp: Path, executor) -> StageContext:
    spec = StageSpec(name="probe", version="1", inputs=(), config_field=None, flow="data_refresh",
                     fn=lambda ctx: {})
    return StageContext(spec=spec, config=None, pipeline=None, key="k", out=tmp / "out", inputs={},
                        input_keys={}, store=_ShardStore(tmp / "store"), executor=executor)


def _digest(results) -> dict[str, str]:
    out = {}
    for d, stats in results:
        for f in sorted(Path(d).glob("*.txt")):
            out[f.name] = hashlib.sha256(f.read_bytes()).hexdigest() + f":{stats['docs']}"
    return out


def test_cached_map_on_dask_matches_local(tmp_path: Path, dask_executor: DaskExecutor) -> None:
    items = [(f"k{i}", (f"s{i}", 50 + i)) for i in range(6)]
    local = _digest(_ctx(tmp_path / "local", LocalExecutor(1)).cached_map(_write_shard, items))
    ctx = _ctx(tmp_path / "dask", dask_executor)
    dask = _digest(ctx.cached_map(_write_shard, items))
    assert dask == local and len(dask) == 6
    # second call: everything cached, nothing recomputed (the files keep their inode)
    inode = (ctx.shard_dir("k0") / "s0.txt").stat().st_ino
    assert _digest(ctx.cached_map(_write_shard, items)) == local
    assert (ctx.shard_dir("k0") / "s0.txt").stat().st_ino == inode


def test_executor_from_config() -> None:
    cfg = types.SimpleNamespace(kind="local", workers=3)
    r = executor_from_config(cfg)
    assert isinstance(r, LocalExecutor) and r.workers == 3
    cfg = types.SimpleNamespace(kind="dask", workers=1, dask_address="tcp://127.0.0.1:1", dask_workers=4,
                                dask_threads_per_worker=1)
    d = executor_from_config(cfg)
    assert isinstance(d, DaskExecutor) and d.scheduler_address == "tcp://127.0.0.1:1"
    with pytest.raises(ValueError, match="executor.kind"):
        executor_from_config(types.SimpleNamespace(kind="ray"))
    with pytest.raises(ValueError, match="n_workers"):
        DaskExecutor(n_workers=0)
