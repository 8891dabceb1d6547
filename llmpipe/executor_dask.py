"""Shard-level work on a Dask cluster: the same stage code, the same artifacts, more machines.

``executor.kind: dask`` in the config selects :class:`DaskExecutor`. It connects to an existing
``distributed`` scheduler (``executor.dask_address``) or starts one :class:`~distributed.LocalCluster`
per process on 127.0.0.1 (``executor.dask_workers`` processes). The stages themselves run one after
another as Prefect tasks in the flow's process (each needs the one before); their shard jobs go to
the cluster.

When ``map`` is called from inside a Dask worker (a caller that itself runs on the cluster), it uses
``worker_client()``, which secedes the calling task from the worker's thread pool while it waits,
so shard jobs submitted from a task cannot deadlock the cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llmpipe.executor import LocalExecutor, ShardExecutor

_CLUSTERS: dict[tuple[int, int], Any] = {}
_LOCK = threading.Lock()


def shared_local_cluster(n_workers: int = 2, threads_per_worker: int = 1) -> Any:
    """One LocalCluster per (workers, threads) in this process, on 127.0.0.1, without a dashboard.

    Shared so that the Prefect task runner and the shard executor of one flow run use the same
    worker processes; closed when the interpreter exits. Its worker processes (started by the
    Nannies, which run in this process) exit when this process dies, through distributed's own
    parent-alive pipe, unless a forked child of ours still holds that pipe; this process's
    watchdog (:func:`llmpipe.processes.guard`) ends them in any case.
    """
    from distributed import LocalCluster

    from llmpipe.processes import guard

    key = (int(n_workers), int(threads_per_worker))
    with _LOCK:
        cluster = _CLUSTERS.get(key)
        if cluster is None or cluster.status.name in ("closing", "closed", "failed"):
            cluster = LocalCluster(
                n_workers=key[0], threads_per_worker=key[1], processes=True,
                host="127.0.0.1", dashboard_address=None,
            )
            guard()  # note its worker processes now, not at the watchdog's next scan
            _CLUSTERS[key] = cluster
        return cluster


@atexit.register
def close_local_clusters() -> None:
    """Close every LocalCluster this process started (also called by tests and benchmarks)."""
    with _LOCK:
        for cluster in _CLUSTERS.values():
            with contextlib.suppress(Exception):
                cluster.close()
        _CLUSTERS.clear()


def _inside_dask_worker() -> bool:
    try:
        from distributed import get_worker

        get_worker()
        return True
    except (ImportError, ValueError):
        return False


class DaskExecutor:
    """Runs ``fn`` over items as Dask futures; results come back in input order.

    ``address`` is an existing scheduler (``tcp://host:8786``); without it a shared LocalCluster
    with ``n_workers`` worker processes is started on first use.
    """

    def __init__(self, address: str | None = None, n_workers: int = 2, threads_per_worker: int = 1) -> None:
        if n_workers < 1 or threads_per_worker < 1:
            raise ValueError(f"DaskExecutor: n_workers and threads_per_worker must be >= 1, "
                             f"got {n_workers} and {threads_per_worker}")
        self.address = address
        self.n_workers = int(n_workers)
        self.threads_per_worker = int(threads_per_worker)
        self.threads_here = False  # items run in the cluster's worker processes
        self.shares_disk = False  # workers may be on other hosts: a URL store is reached by its URL
        self._client: Any = None

    @classmethod
    def from_config(cls, executor_cfg: Any) -> DaskExecutor:
        """From ``PipelineConfig.executor`` (dask_address, dask_workers, dask_threads_per_worker)."""
        return cls(address=getattr(executor_cfg, "dask_address", None) or None,
                   n_workers=int(getattr(executor_cfg, "dask_workers", 2)),
                   threads_per_worker=int(getattr(executor_cfg, "dask_threads_per_worker", 1)))

    @property
    def scheduler_address(self) -> str:
        """The scheduler this executor submits to (starting the LocalCluster if needed)."""
        if self.address:
            return self.address
        return str(shared_local_cluster(self.n_workers, self.threads_per_worker).scheduler_address)

    @property
    def workers(self) -> int:
        """Total worker threads on the cluster: used to size batches of shard jobs."""
        if self._client is None and self.address is None and not _CLUSTERS:
            return self.n_workers * self.threads_per_worker
        try:
            info = self.client().scheduler_info(n_workers=-1)["workers"]
            return max(1, sum(int(w.get("nthreads", 1)) for w in info.values()))
        except Exception:  # noqa: BLE001 - a sizing hint must never fail the run
            return self.n_workers * self.threads_per_worker

    def client(self) -> Any:
        """A client connected to the scheduler (created once, reused)."""
        from distributed import Client

        if self._client is None or self._client.status in ("closing", "closed"):
            self._client = Client(self.scheduler_address, set_as_default=False)
        return self._client

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any],
            on_done: Callable[[int], None] | None = None, threads: bool = False) -> list[Any]:
        """Items as Dask tasks; ``threads`` changes nothing: each Dask worker has its own threads."""
        items = list(items)
        if not items:
            return []
        if _inside_dask_worker():
            from distributed import worker_client

            with worker_client() as wc:
                return _gather(wc, wc.map(fn, items, pure=False), on_done)
        client = self.client()
        return _gather(client, client.map(fn, items, pure=False), on_done)

    def close(self) -> None:
        """Close this executor's client (the shared LocalCluster stays up until exit)."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:  # a live client does not pickle
        state = dict(self.__dict__)
        state["_client"] = None
        return state


def _gather(client: Any, futures: list[Any], on_done: Callable[[int], None] | None) -> list[Any]:
    """Results in item order, reporting progress as futures finish (raises the first error)."""
    if on_done is not None:
        from distributed import as_completed

        for n, _ in enumerate(as_completed(futures, loop=client.loop, raise_errors=False), 1):
            on_done(n)
    return list(client.gather(futures))


def executor_from_config(executor_cfg: Any) -> ShardExecutor:
    """Build the shard executor that ``executor:`` in the pipeline config asks for.

    ``executor_cfg`` is ``PipelineConfig.executor`` (kind, workers, dask_address, dask_workers,
    dask_threads_per_worker).
    """
    kind = getattr(executor_cfg, "kind", "local")
    if kind == "local":
        return LocalExecutor(int(getattr(executor_cfg, "workers", 1)))
    if kind == "dask":
        return DaskExecutor.from_config(executor_cfg)
    raise ValueError(f"executor.kind must be 'local' or 'dask', got {kind!r}")


@contextlib.contextmanager
def dask_processes(root: str | Path, n_workers: int = 2, threads_per_worker: int = 1,
                   timeout: float = 90.0) -> Iterator[str]:
    """A scheduler and ``n_workers`` workers as separate ``dask`` CLI processes on 127.0.0.1.

    What a cluster of machines looks like to the driver, on one machine: the scheduler is not
    started by the driver's client, and each worker runs in a folder of its own under ``root``
    (its cwd, its ``--local-directory`` and its ``TMPDIR``), so no temporary path is shared with
    the driver or with the other worker; only the store is. Yields the scheduler's address. Every
    process is stopped on exit, also on failure (:class:`~llmpipe.processes.ManagedProcess`; the
    watchdog ends them should this process be killed).
    """
    from distributed import Client

    from llmpipe.processes import ManagedProcess, free_ports

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    dask_cli = Path(sys.executable).with_name("dask")
    if not dask_cli.is_file():
        raise RuntimeError(f"{dask_cli}: no `dask` command beside this Python (install the [dask] extra)")
    (port,) = free_ports(1)
    address = f"tcp://127.0.0.1:{port}"
    env = dict(os.environ)
    # the workers unpickle shard functions by module name: the same llmpipe as this process
    code_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code_root, env.get("PYTHONPATH")) if p)
    procs: list[ManagedProcess] = []
    try:
        procs.append(ManagedProcess(
            [dask_cli, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
            root / "scheduler.log", env=env, cwd=root, name="dask-scheduler").start())
        for i in range(n_workers):
            home = root / f"worker-{i}"
            (home / "tmp").mkdir(parents=True, exist_ok=True)
            procs.append(ManagedProcess(
                [dask_cli, "worker", address, "--host", "127.0.0.1", "--name", f"worker-{i}",
                 "--nthreads", str(threads_per_worker), "--nworkers", "1", "--no-dashboard",
                 "--local-directory", home / "dask", "--death-timeout", "60"],
                home / "worker.log", env={**env, "TMPDIR": str(home / "tmp")}, cwd=home,
                name=f"dask-worker-{i}").start())
        try:
            with Client(address, timeout=timeout, set_as_default=False) as client:
                client.wait_for_workers(n_workers, timeout=timeout)
        except Exception as e:
            logs = "\n".join(f"--- {p.name} ({p.log_path})\n{p.tail(20)}" for p in procs)
            raise RuntimeError(f"dask processes under {root} did not come up: {e}\n{logs}") from e
        yield address
    finally:
        for p in reversed(procs):
            p.stop(grace=6.0)
