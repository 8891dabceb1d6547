"""Where a stage's shard jobs run: worker processes of this machine, or a Dask cluster.

A stage calls ``ctx.map(fn, items)``; the executor the config's ``executor:`` section selects runs
``fn`` over the items (:class:`LocalExecutor` here, :class:`llmpipe.executor_dask.DaskExecutor`
across machines) and returns the results in item order. The stage code is the same for both.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from typing import Any, Protocol


class ShardExecutor(Protocol):
    """Runs a picklable top-level function over items; local processes by default, Dask when configured."""

    workers: int
    # ``map(..., threads=True)`` runs several items at once on threads of this process (a library
    # that parallelizes each call on its own pool should then stay on the calling thread)
    threads_here: bool
    # its workers read and write this process's disk (a local pool); False for Dask, whose workers
    # may sit on other hosts: with a URL store, shard jobs then go through the store's URL
    shares_disk: bool

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any],
            on_done: Callable[[int], None] | None = None, threads: bool = False) -> list[Any]:
        """Results in item order; ``on_done(finished_count)`` is called as items finish.

        ``threads``: ``fn`` spends its time outside the GIL (native code that releases it), so a
        local executor may run the items on threads of this process instead of worker processes.
        """
        ...


class LocalExecutor:
    """A process pool over shards; ``workers == 1`` runs in-process (no pickling, easy to debug).

    Work that releases the GIL (``map(..., threads=True)``) runs on a thread pool instead: the
    threads share what the process has loaded (a tokenizer's tables and caches) and pay no fork.
    """

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, int(workers))
        self.threads_here = self.workers > 1
        self.shares_disk = True

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any],
            on_done: Callable[[int], None] | None = None, threads: bool = False) -> list[Any]:
        items = list(items)
        if self.workers == 1 or len(items) <= 1:
            out = []
            for x in items:
                out.append(fn(x))
                if on_done is not None:
                    on_done(len(out))
            return out
        n = min(self.workers, len(items))
        if threads:
            with ThreadPoolExecutor(max_workers=n, thread_name_prefix="llmpipe-shard") as tpool:
                return _in_order(tpool, fn, items, on_done)
        # one pool for every item: a fresh worker pays its warm-up once, not once per batch
        from llmpipe.processes import guard

        guard()  # its workers end with this process even if it is killed (they would wait forever)
        ctx = mp.get_context("fork" if os.name == "posix" else "spawn")
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
            return _in_order(pool, fn, items, on_done)


def _in_order(pool: Executor, fn: Callable[[Any], Any], items: list[Any],
              on_done: Callable[[int], None] | None) -> list[Any]:
    """Submit every item; report each finish; results in item order (the first error raises)."""
    futures = [pool.submit(fn, x) for x in items]
    for done, _ in enumerate(as_completed(futures), 1):
        if on_done is not None:
            on_done(done)
    return [f.result() for f in futures]
