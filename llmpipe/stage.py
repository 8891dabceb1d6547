"""The stage contract: a stage is a function of (its config, its input artifacts) -> one directory.

A stage module registers itself with :func:`stage`; adding a stage to the DAG is one import line in
``llmpipe/pipeline.py``. The DAG (``llmpipe.dag`` from plain Python, ``tasks/`` under Prefect)
computes the stage key, builds a :class:`StageContext` whose ``out`` is a temporary directory, calls
the stage function, and publishes the directory with its manifest. Stage functions never see
Prefect: they report progress, tables and images through the context.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.executor import LocalExecutor, ShardExecutor
from llmpipe.remote_shards import (
    done_marker,
    fetch_shard,
    pull_staged,
    run_remote_job,
    run_remote_shard_job,
    shared_view,
)
from llmpipe.shard_cache import DONE, run_shard_job

log = logging.getLogger("llmpipe")


FLOWS = ("data_refresh", "pretrain", "post_train", "release")
# An input named MODEL is no stage: it is "the model this config tunes last", the last active stage in
# DAG order that declares ``model=True`` (``preference`` if on, else ``sft``, else ``pretrain``). The
# planner resolves it (``llmpipe.dag.resolve_inputs``): the key's inputs name that stage, as a fixed
# input would, and the running stage finds its folder at ``ctx.inputs[MODEL]``.
MODEL = "model"


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
    # a stage that reads from outside the store (ingest): (pipeline config, state dir) ->
    # (its input keys, e.g. each source's content hash; facts for the run, in ctx.extra)
    plan_inputs: Callable[[Any, Path], tuple[dict[str, str], dict[str, Any]]] | None = None
    model: bool = False  # its artifact is a causal-LM folder that a MODEL input may resolve to
    also_flows: tuple[str, ...] = ()  # flows that run it beside ``flow`` (evaluate: post_train too)

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
    plan_inputs: Callable[[Any, Path], tuple[dict[str, str], dict[str, Any]]] | None = None,
    model: bool = False,
    also_flows: Sequence[str] = (),
) -> Callable[[Callable[[StageContext], dict[str, Any]]], Callable[[StageContext], dict[str, Any]]]:
    """Register a stage function. ``inputs`` name upstream stages; their artifacts arrive in ctx.inputs.

    ``requires``: the top-level modules the stage imports that the core install lacks (a callable of
    the pipeline config where that depends on the config, e.g. a backend); ``extra`` is the pip extra
    of its family. A run checks them for the stages it selects, before any work
    (``llmpipe.pipeline.missing_extras``), instead of failing at the first import mid-run.

    ``plan_inputs``: for a stage that reads from outside the store (ingest: the sources; sft: its
    instruction data). The planner adds what it returns to the upstream stages' keys: the stage's
    outside input keys (content hashes, so the stage key changes when the data does) and facts the
    run needs (``ctx.extra``).

    ``model``: the stage writes a causal-LM folder (pretrain, sft, preference); a stage that takes
    ``MODEL`` among its ``inputs`` gets the last active one (see :data:`MODEL`). ``also_flows``: other
    flows that run the stage (evaluate runs in ``post_train`` too, after the tuning stages).
    """
    for f in (flow, *also_flows):
        if f not in FLOWS:
            raise ValueError(f"stage {name!r}: flow must be one of {FLOWS}, got {f!r}")

    def deco(fn: Callable[[StageContext], dict[str, Any]]) -> Callable[[StageContext], dict[str, Any]]:
        STAGES[name] = StageSpec(
            name=name, version=version, inputs=tuple(inputs), config_field=config_field or None,
            flow=flow, fn=fn, description=(fn.__doc__ or "").strip().split("\n")[0], enabled=enabled,
            requires=requires if callable(requires) else tuple(requires), extra=extra,
            plan_inputs=plan_inputs, model=model, also_flows=tuple(also_flows),
        )
        return fn

    return deco


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
    executor: ShardExecutor = field(default_factory=LocalExecutor)
    log: logging.Logger = field(default_factory=lambda: log)
    reports: list[Report] = field(default_factory=list)
    on_progress: Callable[[str, int, int], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # planner-provided facts (e.g. ingest's files)
    # the per-shard results this run used (``cached_map``): the manifest lists them, so ``gc`` keeps
    # the ones a reachable artifact was made from and collects the rest
    shard_keys: list[str] = field(default_factory=list)
    model_from: str | None = None  # the model stage ``inputs[MODEL]`` is (pretrain, sft, preference)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def workers(self) -> int:
        return self.executor.workers

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any],
            on_done: Callable[[int], None] | None = None, threads: bool = False) -> list[Any]:
        """Run ``fn`` over items on the shard executor (process pool or Dask); ``threads``: see ShardExecutor.

        Where the workers do not share this disk and the store is a URL, each item's paths are mapped
        to the worker's copies and what it writes into ``out`` comes back through the store
        (:mod:`llmpipe.remote_shards`).
        """
        if not self.through_store:
            return self.executor.map(fn, items, on_done, threads=threads)
        items = list(items)
        with shared_view(self.store, self.name, self.out, items) as view:
            pairs = self.executor.map(run_remote_job, [(fn, x, view) for x in items], on_done, threads=threads)
        for _result, staged in pairs:
            if staged is not None:
                pull_staged(self.store, staged, self.out)
        return [result for result, _staged in pairs]

    @property
    def through_store(self) -> bool:
        """Shard jobs reach the store by its URL: a remote store and workers off this disk (Dask)."""
        return not getattr(self.store, "is_local", True) and not getattr(self.executor, "shares_disk", True)

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
        ``threads``: ``fn`` releases the GIL for its heavy work (see :meth:`ShardExecutor.map`).
        """
        self.shard_keys.extend(k for k, _a in items)
        remote = self.through_store
        cached = (lambda k: fetch_shard(self.store, self.name, k)) if remote else \
            (lambda k: (self.shard_dir(k) / DONE).exists())
        todo = [(k, a) for k, a in items if not cached(k)]
        self.log.info("%s: %d shards, %d cached, %d to compute", self.name, len(items),
                      len(items) - len(todo), len(todo))
        if todo:
            on_done = lambda n: self.progress(desc, n, len(todo))  # noqa: E731
            if remote:  # the workers write the shards into the store; this process fetches them below
                with shared_view(self.store, self.name, self.out, [a for _k, a in todo]) as view:
                    self.executor.map(run_remote_shard_job, [(fn, a, view, k) for k, a in todo], on_done,
                                      threads=threads)
            else:
                jobs = [(fn, a, str(self.shard_dir(k))) for k, a in todo]
                self.executor.map(run_shard_job, jobs, on_done, threads=threads)
        results = []
        for k, _a in items:
            d = self.shard_dir(k)
            stats = done_marker(self.store, self.name, k) if remote else json.loads((d / DONE).read_text())
            results.append((d, stats))
        return results


def stats_rows(stats: dict[str, Any], fields: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a ``stats`` report: ``{"metric", "value"}`` per field; nested values as JSON text."""
    rows = []
    for name in fields:
        value = stats.get(name)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, default=str)
        rows.append({"metric": name, "value": value})
    return rows


