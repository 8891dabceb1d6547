"""What every flow does: load the config, plan keys, run its stages as tasks, report a table.

The flows differ only in which stages they run (each stage declares its flow when it registers),
so a new stage needs no flow code.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import prefect
from prefect.artifacts import create_table_artifact
from prefect.flows import Flow
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from llmpipe import console
from llmpipe.config import load_config
from llmpipe.dag import check_extras, open_store, plan, resolve_upstream, run_plan, select, summarize_stats
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


def llmpipe_flow(name: str) -> Callable[[Callable[..., Any]], Flow]:
    """``@prefect.flow`` for an llmpipe flow. Not ``log_prints``: it turns every ``print`` in a task
    into a log record, also those a library captures itself (dill disassembles a function into
    ``sys.stdout`` to find its globals: it printed bytecode into the quantize log)."""
    return prefect.flow(name=name)


def run_flow(flow: str, config: str, overrides: list[str] | None, from_stage: str | None = None,
             until: str | None = None) -> list[dict[str, Any]]:
    """Run the stages of ``flow`` (all of them for ``lifecycle``); return one row per stage."""
    logger = get_run_logger()
    cfg = load_config(config, list(overrides or []))
    check_extras(cfg, flow, from_stage, until)  # a worker's run too: refused before any stage works
    store = open_store(cfg)
    planned = plan(cfg)
    chosen = select(planned, flow, from_stage, until)
    arts = resolve_upstream(store, planned, chosen)
    stage_task = stage_task_for(cfg)
    cfg_dict = cfg.model_dump(mode="json")
    rows: list[dict[str, Any]] = []
    t_flow = time.time()
    with store.running(flow, run_plan(chosen, arts)) as begun:  # a gc meanwhile keeps this run's work
        _run_stages(flow, chosen, planned, arts, store, stage_task, cfg_dict, rows, logger)
        store.record_run({"flow": flow, "config": config, "artifacts": {r["stage"]: planned[r["stage"]].key
                                                                         for r in rows},
                          "seconds": round(time.time() - t_flow, 3), "time": time.time()}, replace=begun)
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
    run_console = console.active()  # `llmpipe run` in this process: one line per stage on its terminal
    try:
        for index, ps in enumerate(chosen, 1):
            if run_console is not None:
                run_console.stage_started(index, len(chosen), ps.name)
            t0 = time.time()
            # quote: Prefect would otherwise walk the whole config (and ingest's file list) looking
            # for futures, for every task; nothing in them is a future
            state = stage_task.with_options(name=f"stage-{ps.name}", task_run_name=ps.name)(
                stage=ps.name, key=ps.key, config=quote(cfg_dict),
                planned=quote({"key_config": ps.key_config, "input_keys": ps.input_keys, "extra": ps.extra,
                               "model_from": ps.model_from}),
                upstream={d: planned[d].key for d in ps.upstream}, return_state=True)
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
            if run_console is not None:
                run_console.stage_finished(index, len(chosen), rows[-1])
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


def publish_lr_find(result: Any, png: Any) -> None:
    """The LR finder's curve and suggestion as Prefect artifacts (``llmpipe lr-find`` with a server up)."""
    import base64

    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    create_markdown_artifact(
        key="lr-find", description="LR finder: loss against learning rate",
        markdown=f"Suggested learning rate **{result.suggested_lr:.3g}** ({result.rule}).\n\n![lr finder]({url})")
    create_table_artifact(key="lr-find-curve", description="LR finder: the sweep",
                          table=[{"lr": lr, "loss": loss, "smoothed": sm}
                                 for lr, loss, sm in zip(result.lrs, result.losses, result.smoothed, strict=True)])
