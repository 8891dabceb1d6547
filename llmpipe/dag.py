"""Plan and run the DAG without Prefect: keys first, then stages in order, reusing what exists.

A stage's key depends only on its code version, its config and its inputs' keys, so the whole plan
(every stage's key, and whether the store already holds it) is known before any work starts. The
Prefect layer (``tasks/``, ``flows/``) calls :func:`execute` inside a task; tests and notebooks can
call :func:`run_pipeline` directly.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe import console
from llmpipe.config import PipelineConfig
from llmpipe.executor import LocalExecutor, ShardExecutor
from llmpipe.pipeline import load_stages, missing_extras
from llmpipe.stage import MODEL, StageContext, StageSpec
from llmpipe.store import Artifact, ArtifactStore, stage_key

log = logging.getLogger("llmpipe.dag")
REPORTS = "reports.json"


class StageFailed(RuntimeError):
    """A stage raised; the message names the stage."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"stage {stage!r} failed: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


class MissingInput(RuntimeError):
    pass


@dataclass
class PlannedStage:
    spec: StageSpec
    key: str
    key_config: Any
    input_keys: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)
    # the upstream stages it reads, ``MODEL`` resolved (None: the spec's inputs, which name no MODEL)
    inputs: tuple[str, ...] | None = None
    model_from: str | None = None  # the stage its MODEL input resolved to

    def __post_init__(self) -> None:
        if self.inputs is None:
            self.inputs = self.spec.inputs

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def upstream(self) -> tuple[str, ...]:
        """The upstream stages whose artifacts the run reads (``MODEL`` resolved)."""
        return tuple(self.inputs or ())


def state_dir(cfg: PipelineConfig | dict[str, Any]) -> Path:
    p = Path(cfg["state_dir"] if isinstance(cfg, dict) else cfg.state_dir)
    return p if p.is_absolute() else Path.cwd() / p


def open_store(cfg: PipelineConfig | dict[str, Any]) -> ArtifactStore:
    """The config's store; also from a dumped config (a cache-key check need not re-validate it)."""
    root = cfg["store"] if isinstance(cfg, dict) else cfg.store
    return ArtifactStore(root, cache_dir=state_dir(cfg) / "store-cache")


def section(cfg: PipelineConfig, spec: StageSpec) -> Any:
    return getattr(cfg, spec.config_field) if spec.config_field else None


def active_stages(cfg: PipelineConfig) -> dict[str, StageSpec]:
    """The stages this config runs, in DAG order: an optional stage (``StageSpec.enabled``, e.g. ``sft``)
    is left out of the plan unless the config turns it on, so it adds no key, no extra and no work."""
    return {n: s for n, s in load_stages().items() if s.enabled is None or s.enabled(cfg)}


def resolve_inputs(spec: StageSpec, before: list[StageSpec]) -> tuple[tuple[str, ...], str | None]:
    """(the upstream stages ``spec`` reads, the stage its ``MODEL`` input names or None).

    ``MODEL`` is the last of ``before`` (the active stages ahead of it, in DAG order) that declares
    ``model=True``: the tuned model when post-training is on, else pretrain's. The key's inputs name
    that stage, so a config without post-training keeps the keys a fixed ``pretrain`` input gave.
    """
    if MODEL not in spec.inputs:
        return spec.inputs, None
    models = [s.name for s in before if s.model]
    if not models:
        raise ValueError(f"stage {spec.name!r} takes the model, but no active stage before it makes one")
    return tuple(models[-1] if d == MODEL else d for d in spec.inputs), models[-1]


def plan(cfg: PipelineConfig) -> dict[str, PlannedStage]:
    """Every stage's key, in DAG order. Raw sources are hashed here (with a size/mtime fast path)."""
    stages = active_stages(cfg)
    out: dict[str, PlannedStage] = {}
    for name, spec in stages.items():
        sec = section(cfg, spec)
        key_config = sec.key_dict() if sec is not None else None
        extra: dict[str, Any] = {}
        inputs, model_from = resolve_inputs(spec, [out[n].spec for n in out])
        input_keys = {dep: out[dep].key for dep in inputs}
        if spec.plan_inputs is not None:  # reads outside the store (ingest: the sources; sft: its data)
            outside, extra = spec.plan_inputs(cfg, state_dir(cfg))
            input_keys.update(outside)
        key = stage_key(name, spec.version, key_config, input_keys)
        out[name] = PlannedStage(spec, key, key_config, input_keys, extra, inputs, model_from)
    return out


def check_stage_range(start: str | None, until: str | None, names: list[str] | None = None) -> None:
    """Raise ValueError naming the option when --from or --until is not a stage (no keys computed)."""
    names = list(load_stages()) if names is None else names
    for opt, val in (("--from", start), ("--until", until)):
        if val is not None and val not in names:
            raise ValueError(f"{opt} {val}: unknown stage; stages: {', '.join(names)}")


def selected_stages(stages: dict[str, StageSpec], flow: str | None = None, start: str | None = None,
                    until: str | None = None) -> list[StageSpec]:
    """The stages a run executes: a flow's stages (``None``/``lifecycle``: all), cut by --from/--until."""
    names = list(stages)
    check_stage_range(start, until, names)
    lo = names.index(start) if start else 0
    hi = names.index(until) if until else len(names) - 1
    chosen = [stages[n] for n in names[lo : hi + 1]]
    if flow and flow != "lifecycle":
        chosen = [s for s in chosen if s.flow == flow or flow in s.also_flows]
    return chosen


def select(planned: dict[str, PlannedStage], flow: str | None = None, start: str | None = None,
           until: str | None = None) -> list[PlannedStage]:
    """The planned stages a run executes (see :func:`selected_stages`)."""
    specs = {n: p.spec for n, p in planned.items()}
    return [planned[s.name] for s in selected_stages(specs, flow, start, until)]


def check_extras(cfg: PipelineConfig, flow: str | None = None, start: str | None = None,
                 until: str | None = None) -> None:
    """Raise ``MissingExtra`` when a stage this run selects needs an uninstalled pip extra.

    No key is computed and nothing is imported: a curation-only install is refused ``pretrain`` in
    milliseconds, not after curating for minutes.
    """
    active = active_stages(cfg)
    for opt, val in (("--from", start), ("--until", until)):
        if val is not None and val not in active and val in load_stages():
            raise ValueError(f"{opt} {val}: the stage is off in this config (set {val}'s enabled: true, "
                             "e.g. configs/tiny-chat.yaml)")
    missing_extras(selected_stages(active, flow, start, until), cfg)


def make_executor(cfg: PipelineConfig) -> ShardExecutor:
    """Local processes, or the Dask cluster the config names (imported only when asked for)."""
    if cfg.executor.kind == "dask":
        from llmpipe.executor_dask import DaskExecutor

        return DaskExecutor.from_config(cfg.executor)
    return LocalExecutor(cfg.executor.workers)


def execute(cfg: PipelineConfig, store: ArtifactStore, ps: PlannedStage, upstream: dict[str, Artifact],
            executor: ShardExecutor | None = None, logger: logging.Logger | None = None,
            on_progress: Callable[[str, int, int], None] | None = None) -> tuple[Artifact, bool, float]:
    """Reuse the stage's artifact if it verifies, else compute and publish it: (artifact, ran, seconds)."""
    t0 = time.time()
    hit = store.get(ps.name, ps.key)
    if hit is not None:
        return hit, False, time.time() - t0
    missing = [d for d in ps.upstream if d not in upstream]
    if missing:
        raise MissingInput(f"stage {ps.name!r}: inputs {missing} not given")
    inputs = {d: upstream[d].path for d in ps.upstream}
    if ps.model_from is not None:  # the stage reads ctx.inputs[MODEL]; the key names the stage it is
        inputs[MODEL] = inputs[ps.model_from]
    tmp = store.new_tmp_dir(ps.name, ps.key)
    ctx = StageContext(
        spec=ps.spec, config=section(cfg, ps.spec), pipeline=cfg, key=ps.key, out=tmp,
        inputs=inputs, input_keys=dict(ps.input_keys),
        store=store, executor=executor or make_executor(cfg),  # one it makes, it closes
        log=logger or logging.getLogger(f"llmpipe.{ps.name}"), on_progress=on_progress, extra=ps.extra,
        model_from=ps.model_from,
    )
    try:
        stats = ps.spec.fn(ctx) or {}
        (tmp / REPORTS).write_text(json.dumps([_portable(r.__dict__, tmp) for r in ctx.reports],
                                              default=str, indent=1))
        art = store.publish(ps.name, ps.key, tmp, version=ps.spec.version, config=ps.key_config,
                            inputs=ps.input_keys, stats=stats, started=t0, shards=ctx.shard_keys)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise StageFailed(ps.name, e) from e
    finally:
        if executor is None and hasattr(ctx.executor, "close"):  # a Dask client: its scheduler connection
            ctx.executor.close()
    return art, True, time.time() - t0


def _portable(report: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Image paths relative to the artifact (the temporary directory is renamed after the run)."""
    if report["kind"] == "image":
        p = Path(report["payload"])
        if p.is_absolute() and p.is_relative_to(tmp):
            report = {**report, "payload": p.relative_to(tmp).as_posix()}
    return report


def resolve_upstream(store: ArtifactStore, planned: dict[str, PlannedStage], chosen: list[PlannedStage],
                     ) -> dict[str, Artifact]:
    """Artifacts of the stages a run needs but does not execute (e.g. ``--from pretrain``)."""
    chosen_names = {p.name for p in chosen}
    needed = {d for p in chosen for d in p.upstream if d not in chosen_names}
    out = {}
    for name in needed:
        art = store.get(name, planned[name].key)
        if art is None:
            raise MissingInput(
                f"stage {name!r} (key {planned[name].key[:12]}) has no artifact in {store.url}; "
                f"run it first (e.g. `llmpipe run CONFIG --until {name}` or the data_refresh flow)")
        out[name] = art
    return out


@dataclass
class StageRun:
    stage: str
    key: str
    ran: bool
    seconds: float
    path: str
    stats: dict[str, Any]


def run_pipeline(cfg: PipelineConfig, flow: str | None = None, start: str | None = None,
                 until: str | None = None) -> list[StageRun]:
    """Run (or reuse) the selected stages in order, without Prefect."""
    check_extras(cfg, flow, start, until)
    store = open_store(cfg)
    planned = plan(cfg)
    chosen = select(planned, flow, start, until)
    arts = resolve_upstream(store, planned, chosen)
    with store.running(flow or "lifecycle", run_plan(chosen, arts)) as begun:
        runs = []
        run_console = console.active()
        for i, ps in enumerate(chosen, 1):
            if run_console is not None:
                run_console.stage_started(i, len(chosen), ps.name)
            with console.stage_output(ps.name):
                art, ran, secs = execute(cfg, store, ps, arts,
                                         on_progress=run_console.progress if run_console is not None else None)
            arts[ps.name] = art
            runs.append(StageRun(ps.name, ps.key, ran, secs, str(art.path), art.stats))
            if run_console is not None:
                run_console.stage_finished(i, len(chosen), {"stage": ps.name, "status": "ran" if ran else "cached",
                                                            "seconds": secs})
        store.record_run({"flow": flow or "lifecycle", "artifacts": {r.stage: r.key for r in runs},
                          "pid": os.getpid(), "time": time.time()}, replace=begun)
    return runs


def run_plan(chosen: list[PlannedStage], upstream: dict[str, Artifact]) -> dict[str, str]:
    """stage -> key of every artifact a run will read or write: what its start record protects from gc."""
    return {**{name: art.key for name, art in upstream.items()}, **{ps.name: ps.key for ps in chosen}}


def summarize_stats(stats: dict[str, Any], limit: int = 4) -> str:
    """A short 'k=v' string of a stage's top-level numeric stats, for tables."""
    items = [(k, v) for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in items[:limit])
