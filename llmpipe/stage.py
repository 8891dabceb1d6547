"""The stage contract: a stage is a function of (its config, its input artifacts) -> one directory.

A stage module registers itself with :func:`stage`; adding a stage to the DAG is one import line in
``llmpipe/pipeline.py``. The runner (``llmpipe.runner`` from plain Python, ``tasks/`` under Prefect)
computes the stage key, builds a :class:`StageContext` whose ``out`` is a temporary directory, calls
the stage function, and publishes the directory with its manifest. Stage functions never see
Prefect: they report progress, tables and images through the context.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("llmpipe")


class _LazyModule(types.ModuleType):
    """Stands in for a module until its first attribute is read; then imports it and mirrors it."""

    def __getattr__(self, attr: str) -> Any:
        mod = importlib.import_module(self.__name__)
        # copy the namespace so later reads are plain dict hits (hot loops pay nothing after the first)
        self.__dict__.update({k: v for k, v in vars(mod).items() if k != "__getattr__"})
        return getattr(mod, attr)


def lazy_import(name: str) -> Any:
    """``np = lazy_import("numpy")``: the import happens when the stage first uses ``np``, not on import.

    Every ``llmpipe`` command (``status``, a cached rerun) imports all stage modules to learn the DAG;
    a stage module that imports torch, numba or pyarrow at the top would make each of them pay seconds
    for libraries only a running stage needs. Already imported modules are returned as they are.
    """
    return sys.modules.get(name) or _LazyModule(name)


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored as it was after).

    For code that creates very many long-lived or acyclic containers: imports of large libraries,
    unpickling an LSH index, per-token work on millions of small objects. The collector's repeated
    passes over the growing heap find nothing to free there; reference counting still frees
    everything that is dropped.
    """
    global _GC_PAUSES, _GC_WAS_ENABLED
    with _GC_LOCK:  # threads may pause at once: the first in disables, the last out restores
        if _GC_PAUSES == 0:
            _GC_WAS_ENABLED = gc.isenabled()
            gc.disable()
        _GC_PAUSES += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES -= 1
            if _GC_PAUSES == 0 and _GC_WAS_ENABLED:
                gc.enable()


_GC_LOCK = threading.Lock()
_GC_PAUSES = 0
_GC_WAS_ENABLED = True


FLOWS = ("data_refresh", "pretrain", "release")


@dataclass(frozen=True)
class StageSpec:
    """What the DAG needs to know about a stage."""

    name: str
    version: str  # bump when the code changes what the stage produces
    inputs: tuple[str, ...]
    config_field: str | None  # attribute of PipelineConfig holding this stage's Section
    flow: str  # one of FLOWS: the flow that runs it (``lifecycle`` runs all)
    fn: Callable[[StageContext], dict[str, Any]]
    description: str = ""
    enabled: Callable[[Any], bool] | None = None  # pipeline config -> runs? (else passes input through)
    # top-level modules it imports beyond the core install, or pipeline config -> those modules
    requires: tuple[str, ...] | Callable[[Any], Sequence[str]] = ()
    extra: str | None = None  # the pip extra of its stage family (llmpipe.pipeline.EXTRAS)

    def required_modules(self, pipeline: Any) -> tuple[str, ...]:
        """What this stage imports when it runs with ``pipeline`` (a PipelineConfig)."""
        mods = self.requires(pipeline) if callable(self.requires) else self.requires
        return tuple(dict.fromkeys(mods))


STAGES: dict[str, StageSpec] = {}


def stage(
    name: str,
    *,
    version: str,
    inputs: Sequence[str] = (),
    config_field: str | None = None,
    flow: str = "data_refresh",
    enabled: Callable[[Any], bool] | None = None,
    requires: Sequence[str] | Callable[[Any], Sequence[str]] = (),
    extra: str | None = None,
) -> Callable[[Callable[[StageContext], dict[str, Any]]], Callable[[StageContext], dict[str, Any]]]:
    """Register a stage function. ``inputs`` name upstream stages; their artifacts arrive in ctx.inputs.

    ``requires``: the top-level modules the stage imports that the core install lacks (a callable of
    the pipeline config where that depends on the config, e.g. a backend); ``extra`` is the pip extra
    of its family. A run checks them for the stages it selects, before any work
    (``llmpipe.pipeline.missing_extras``), instead of failing at the first import mid-run.
    """
    if flow not in FLOWS:
        raise ValueError(f"stage {name!r}: flow must be one of {FLOWS}, got {flow!r}")

    def deco(fn: Callable[[StageContext], dict[str, Any]]) -> Callable[[StageContext], dict[str, Any]]:
        STAGES[name] = StageSpec(
            name=name, version=version, inputs=tuple(inputs), config_field=config_field or None,
            flow=flow, fn=fn, description=(fn.__doc__ or "").strip().split("\n")[0], enabled=enabled,
            requires=requires if callable(requires) else tuple(requires), extra=extra,
        )
        return fn

    return deco


class ShardRunner(Protocol):
    """Runs a picklable top-level function over items; local processes by default, Dask when configured."""

    workers: int

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any],
            on_done: Callable[[int], None] | None = None, threads: bool = False) -> list[Any]:
        """Results in item order; ``on_done(finished_count)`` is called as items finish.

        ``threads``: ``fn`` spends its time outside the GIL (native code that releases it), so a
        local runner may run the items on threads of this process instead of worker processes.
        """
        ...


class LocalRunner:
    """A process pool over shards; ``workers == 1`` runs in-process (no pickling, easy to debug).

    Work that releases the GIL (``map(..., threads=True)``) runs on a thread pool instead: the
    threads share what the process has loaded (a tokenizer's tables and caches) and pay no fork.
    """

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, int(workers))

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
        from llmpipe.ops.process import guard

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


@dataclass
class Report:
    """Something for the UI: a table (list of row dicts), markdown text, an image file in the artifact,
    or the names of stats to show as a table (their values are in the manifest, not the artifact)."""

    # "table" | "markdown" | "image" | "stats" (a table of manifest stats, see report_stats) |
    # "stats-table" | "stats-markdown" (content in one stats field, see report_from_stats)
    kind: str
    key: str  # a slug: lowercase letters, digits and dashes
    title: str
    payload: Any


@dataclass
class StageContext:
    """What a running stage gets. Write every output file under ``out``."""

    spec: StageSpec
    config: Any  # this stage's Section (None when the stage has no config)
    pipeline: Any  # the whole PipelineConfig
    key: str
    out: Path
    inputs: dict[str, Path]
    input_keys: dict[str, str]
    store: Any  # llmpipe.store.ArtifactStore
    runner: ShardRunner = field(default_factory=LocalRunner)
    log: logging.Logger = field(default_factory=lambda: log)
    reports: list[Report] = field(default_factory=list)
    on_progress: Callable[[str, int, int], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # runner-provided facts (e.g. ingest's files)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def workers(self) -> int:
        return self.runner.workers

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any],
            on_done: Callable[[int], None] | None = None, threads: bool = False) -> list[Any]:
        """Run ``fn`` over items on the shard runner (process pool or Dask); ``threads``: see ShardRunner."""
        return self.runner.map(fn, items, on_done, threads=threads)

    def progress(self, desc: str, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(desc, done, total)

    def report_table(self, key: str, title: str, rows: list[dict[str, Any]]) -> None:
        self.reports.append(Report("table", key, title, rows))

    def report_markdown(self, key: str, title: str, markdown: str) -> None:
        self.reports.append(Report("markdown", key, title, markdown))

    def report_image(self, key: str, title: str, path: Path) -> None:
        """``path`` is a PNG inside ``out``; the UI shows it as a markdown image."""
        self.reports.append(Report("image", key, title, str(path)))

    def report_stats(self, key: str, title: str, fields: Sequence[str]) -> None:
        """A table of some of the stats this stage returns: measurements (timings, throughput, latency).

        Those differ between two runs of the same key, so they never enter the artifact's files: its
        ``reports.json`` names the fields only, and the table's values are read from the manifest's
        stats when the report is shown (:func:`stats_rows`).
        """
        self.reports.append(Report("stats", key, title, list(fields)))

    def report_from_stats(self, kind: str, key: str, title: str, field: str) -> None:
        """A table (``kind="table"``) or markdown report whose content is the stats field ``field``.

        For what depends on more than this stage's key, such as a comparison with the store's
        previous artifact of the stage: two stores that ran the same key hold the same files, so
        that content lives in the manifest's stats and ``reports.json`` only names the field.
        """
        if kind not in ("table", "markdown"):
            raise ValueError(f"report_from_stats: kind must be 'table' or 'markdown', got {kind!r}")
        self.reports.append(Report(f"stats-{kind}", key, title, field))

    # -- per-shard cache: a refresh that adds files only processes the new shards ---------------
    def shard_dir(self, shard_key: str) -> Path:
        """Where a finished shard result lives in the store (``<store>/<stage>/_shards/<key>``)."""
        return self.store.shard_cache_root(self.name) / shard_key

    def cached_map(
        self,
        fn: Callable[[Any, Path], dict[str, Any]],
        items: Sequence[tuple[str, Any]],
        desc: str = "shards",
        threads: bool = False,
    ) -> list[tuple[Path, dict[str, Any]]]:
        """Run ``fn(arg, out_dir) -> stats`` for each ``(shard_key, arg)`` whose result is not cached.

        ``shard_key`` must hash everything the shard's output depends on (stage version, key config,
        the input shard's content). Results are written to a temporary sibling and renamed, so a
        killed run leaves nothing that a later run trusts. Returns ``(shard_dir, stats)`` per item.
        ``threads``: ``fn`` releases the GIL for its heavy work (see :meth:`ShardRunner.map`).
        """
        todo = [(k, a) for k, a in items if not (self.shard_dir(k) / _DONE).exists()]
        self.log.info("%s: %d shards, %d cached, %d to compute", self.name, len(items),
                      len(items) - len(todo), len(todo))
        if todo:
            jobs = [(fn, a, str(self.shard_dir(k))) for k, a in todo]
            self.map(_run_shard_job, jobs, lambda n: self.progress(desc, n, len(jobs)), threads=threads)
        results = []
        for k, _a in items:
            d = self.shard_dir(k)
            results.append((d, json.loads((d / _DONE).read_text())))
        return results


_DONE = "_DONE.json"


def stats_rows(stats: dict[str, Any], fields: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a ``stats`` report: ``{"metric", "value"}`` per field; nested values as JSON text."""
    rows = []
    for name in fields:
        value = stats.get(name)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, default=str)
        rows.append({"metric": name, "value": value})
    return rows


def _run_shard_job(job: tuple[Callable[[Any, Path], dict[str, Any]], Any, str]) -> None:
    fn, arg, final = job
    final_path = Path(final)
    tmp = final_path.parent / f".tmp-{final_path.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stats = fn(arg, tmp) or {}
    stats.setdefault("seconds", round(time.perf_counter() - t0, 4))
    (tmp / _DONE).write_text(json.dumps(stats, sort_keys=True))
    try:
        os.rename(tmp, final_path)
    except OSError:  # another worker finished the same shard first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def link_file(src: Path, dst: Path) -> None:
    """Place ``src`` at ``dst`` without copying bytes when the filesystem allows (hard link)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
