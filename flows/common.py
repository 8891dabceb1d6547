"""What every flow does: load the config, plan keys, run its stages as tasks, report a table.

The flows differ only in which stages they run (each stage declares its flow when it registers),
so a new stage needs no flow code.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from prefect.artifacts import create_table_artifact
from prefect.flows import Flow
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from llmpipe.config import load_config
from llmpipe.runner import open_store, plan, resolve_upstream, select, summarize_stats
from llmpipe.store import Artifact
from tasks.stages import (
    latest_descriptions,
    link_cached_reports,
    publish_reports,
    report_keys,
    stage_task_for,
)

DEFAULT_CONFIG = "configs/tiny.yaml"
log = logging.getLogger(__name__)

# Seconds between flow-run heartbeats that ``run_flow`` emits itself. ``llmpipe run`` sets it when
# it takes the heartbeat over from Prefect's engine (see ``flows.cli.run_flow_in_process``); None
# leaves heartbeats to Prefect (deployments, workers, a flow called from Python).
HEARTBEAT_SECONDS: int | None = None


@contextmanager
def flow_run_heartbeats(seconds: int | None) -> Iterator[None]:
    """Emit ``prefect.flow-run.heartbeat`` for the current flow run every ``seconds``; stop at once.

    The same event, resource and related resources as Prefect's engine (so a zombie-flow automation
    sees no difference), but the thread waits on an ``Event`` rather than in one-second sleeps:
    Prefect's engine joins its heartbeat thread at the end of every flow run, which cost 0-1 s
    (0.5 s on average) of each ``llmpipe run``, about a seventh of a no-change rerun.
    """
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    if not seconds or run is None:
        yield
        return
    from prefect import __version__
    from prefect.events import emit_event
    from prefect.events.related import RelatedResource, tags_as_related_resources

    resource = {"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.name": run.name or "",
                "prefect.version": __version__}
    related = [RelatedResource.model_validate({"prefect.resource.id": f"prefect.flow.{run.flow_id}",
                                               "prefect.resource.role": "flow",
                                               "prefect.resource.name": ctx.flow.name if ctx.flow else ""})]
    if run.deployment_id:
        related.append(RelatedResource.model_validate({"prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                                                       "prefect.resource.role": "deployment"}))
    related += tags_as_related_resources(set(run.tags or []))
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                emit_event(event="prefect.flow-run.heartbeat", resource=resource, related=related)
            except Exception:  # a missed heartbeat must never fail the run
                log.debug("flow-run heartbeat failed", exc_info=True)
            if stop.wait(seconds):
                return

    # the copied context carries the settings (API URL) into the thread, as Prefect's engine does
    thread = threading.Thread(target=contextvars.copy_context().run, args=(beat,), daemon=True,
                              name="llmpipe-heartbeat")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=2)


class PlainParamsFlow(Flow):
    """A Prefect flow that stores plain JSON parameters as they are.

    Prefect passes every flow parameter through FastAPI's ``jsonable_encoder`` before creating the
    run, which imports FastAPI (0.15-0.25 s) in every ``llmpipe run``. Our flows take strings and
    lists of strings; anything else (or any other type) still goes through Prefect's encoder.
    """

    def serialize_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        if all(_plain_json(v) for v in parameters.values()):
            return {k: _copy_json(v) for k, v in parameters.items()}
        return super().serialize_parameters(parameters)


def llmpipe_flow(name: str) -> Callable[[Callable[..., Any]], PlainParamsFlow]:
    """``@prefect.flow(name=..., log_prints=True)``, building a :class:`PlainParamsFlow`."""
    return lambda fn: PlainParamsFlow(fn=fn, name=name, log_prints=True)


def _plain_json(value: Any) -> bool:
    """None, str, int, bool, a finite float, or lists and str-keyed dicts of them (exact types only)."""
    kind = type(value)
    if value is None or kind in (str, int, bool):
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is list:
        return all(_plain_json(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _plain_json(v) for k, v in value.items())
    return False


def _copy_json(value: Any) -> Any:
    if type(value) is list:
        return [_copy_json(v) for v in value]
    if type(value) is dict:
        return {k: _copy_json(v) for k, v in value.items()}
    return value


def run_flow(flow: str, config: str, overrides: list[str] | None, from_stage: str | None = None,
             until: str | None = None) -> list[dict[str, Any]]:
    """Run the stages of ``flow`` (all of them for ``lifecycle``); return one row per stage."""
    logger = get_run_logger()
    cfg = load_config(config, list(overrides or []))
    store = open_store(cfg)
    planned = plan(cfg)
    chosen = select(planned, flow, from_stage, until)
    arts = resolve_upstream(store, planned, chosen)
    stage_task = stage_task_for(cfg)
    cfg_dict = cfg.model_dump(mode="json")
    rows: list[dict[str, Any]] = []
    t_flow = time.time()
    with flow_run_heartbeats(HEARTBEAT_SECONDS):
        _run_stages(flow, chosen, planned, arts, store, stage_task, cfg_dict, rows, logger)
    store.record_run({"flow": flow, "config": config, "artifacts": {r["stage"]: planned[r["stage"]].key
                                                                     for r in rows},
                      "seconds": round(time.time() - t_flow, 3), "time": time.time()})
    return rows


def _run_stages(flow: str, chosen: list[Any], planned: dict[str, Any], arts: dict[str, Any], store: Any,
                stage_task: Any, cfg_dict: dict[str, Any], rows: list[dict[str, Any]], logger: Any) -> None:
    """Each chosen stage as a task, in order; a row per stage; the stage table and reused reports at the end.

    The API calls around the stages run in threads, so a no-change rerun does not wait for the server
    three times in a row: which reports the server already shows is asked while the stages run
    (for the stages whose artifacts are in the store now), and the stage table and the reused-reports
    note are created together at the end.
    """
    reused: list[Artifact] = []
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="llmpipe-api")
    present = [a for a in (store.get(ps.name, ps.key, verify=False) for ps in chosen) if a is not None]
    shown = _in_thread(pool, latest_descriptions, report_keys(present))
    try:
        for ps in chosen:
            t0 = time.time()
            # quote: Prefect would otherwise walk the whole config (and ingest's file list) looking
            # for futures, for every task; nothing in them is a future
            state = stage_task.with_options(name=f"stage-{ps.name}", task_run_name=ps.name)(
                stage=ps.name, key=ps.key, config=quote(cfg_dict),
                planned=quote({"key_config": ps.key_config, "input_keys": ps.input_keys, "extra": ps.extra}),
                upstream={d: planned[d].key for d in ps.spec.inputs}, return_state=True)
            result = state.result()  # raises the stage's error (flow fails, stage named)
            cached = state.name == "Cached" or not result["ran"]
            art = store.get(ps.name, ps.key, verify=False)
            arts[ps.name] = art
            if art is not None and cached:
                reused.append(art)  # its reports are on the server already: linked once, below
            elif art is not None:
                publish_reports(art, ps.name)
            rows.append({"stage": ps.name, "key": ps.key[:12], "status": "cached" if cached else "ran",
                         "state": state.name,
                         "seconds": round(time.time() - t0, 2), "counts": summarize_stats(result["stats"])})
            logger.info("stage %-10s %s  %s", ps.name, rows[-1]["status"], ps.key[:12])
    finally:
        calls = []
        if rows:
            calls.append(_in_thread(pool, create_table_artifact, table=rows, key=f"{flow.replace('_', '-')}-stages",
                                    description=f"{flow}: stages, keys, cached or ran, seconds, counts"))
        if reused:
            link_cached_reports(reused, flow, latest=_answer(shown))
        for call in calls:
            call.result()
        pool.shutdown(wait=True)


def _in_thread(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
    """``fn`` in ``pool`` with this thread's context (the flow run that artifacts attach to, settings)."""
    return pool.submit(contextvars.copy_context().run, fn, *args, **kwargs)


def _answer(fut: Future[dict[str, str]]) -> dict[str, str] | None:
    """The prefetched answer, or None (ask again) when that call failed."""
    try:
        return fut.result()
    except Exception:
        log.debug("prefetching the published reports failed", exc_info=True)
        return None
