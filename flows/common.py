"""What every flow does: load the config, plan keys, run its stages as tasks, report a table.

The flows differ only in which stages they run (each stage declares its flow when it registers),
so a new stage needs no flow code.
"""

from __future__ import annotations

import time
from typing import Any

from prefect.artifacts import create_table_artifact
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from llmpipe.config import load_config
from llmpipe.runner import open_store, plan, resolve_upstream, select, summarize_stats
from llmpipe.store import Artifact
from tasks.stages import link_cached_reports, publish_reports, stage_task_for

DEFAULT_CONFIG = "configs/tiny.yaml"


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
    reused: list[Artifact] = []
    t_flow = time.time()
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
        if rows:
            create_table_artifact(table=rows, key=f"{flow.replace('_', '-')}-stages",
                                  description=f"{flow}: stages, keys, cached or ran, seconds, counts")
        if reused:
            link_cached_reports(reused, flow)
    store.record_run({"flow": flow, "config": config, "artifacts": {r["stage"]: planned[r["stage"]].key
                                                                     for r in rows},
                      "seconds": round(time.time() - t_flow, 3), "time": time.time()})
    return rows
