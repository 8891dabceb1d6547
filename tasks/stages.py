"""The Prefect task that runs one stage.

The task's cache key *is* the stage key, and its result is persisted under the store, so Prefect
shows ``Cached`` exactly when the store holds a verified artifact for that key. If the artifact was
removed or no longer verifies, the key function returns a fresh key and the task runs again.
Retries happen on I/O errors only: a bug or bad data fails the first time, with the stage named.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import TaskRunContext
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from llmpipe import console
from llmpipe.config import PipelineConfig
from llmpipe.dag import REPORTS, PlannedStage, StageFailed, execute, make_executor, open_store
from llmpipe.stage import STAGES, stats_rows
from llmpipe.store import Artifact

RESULTS_DIR = "_prefect_results"


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    name, key = parameters["stage"], parameters["key"]
    store = open_store(_unquoted(parameters["config"]))  # the dumped config was validated by the flow
    if store.get(name, key) is None:  # missing or no longer verifies: forget Prefect's record, run again
        (store.local / RESULTS_DIR / f"{name}-{key}").unlink(missing_ok=True)
    return f"{name}-{key}"


def _unquoted(value: Any) -> Any:
    """The value inside a ``prefect.utilities.annotations.quote`` (the flow passes big inputs quoted)."""
    return value.unquote() if isinstance(value, quote) else value


def _io_only(task: Any, task_run: Any, state: Any) -> bool:
    """Retry when the stage failed on I/O (network filesystem, object store), never on bugs or data."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - the state carries no result: don't retry
        return False
    err = exc.error if isinstance(exc, StageFailed) else exc
    return isinstance(err, (OSError, TimeoutError)) and not isinstance(err, (FileNotFoundError, PermissionError))


@task(name="stage", persist_result=True, retries=2, retry_delay_seconds=5, retry_condition_fn=_io_only,
      cache_key_fn=_cache_key)
def run_stage(stage: str, key: str, config: dict[str, Any], planned: dict[str, Any],
              upstream: dict[str, str]) -> dict[str, Any]:
    """Run (or reuse) one stage; returns where its artifact is and what it counted."""
    logger = get_run_logger()
    cfg = PipelineConfig.model_validate(config)
    store = open_store(cfg)
    spec = STAGES[stage]
    ps = PlannedStage(spec, key, planned["key_config"], planned["input_keys"], planned.get("extra", {}),
                      tuple(upstream), planned.get("model_from"))
    arts = {}
    for name, ukey in upstream.items():
        art = store.get(name, ukey)
        if art is None:
            raise RuntimeError(f"stage {stage!r}: input {name} ({ukey[:12]}) vanished from the store")
        arts[name] = art
    progress_id = create_progress_artifact(progress=0.0, description=f"{stage}: progress")
    last = [0.0]
    bars: dict[str, Any] = {}

    def on_progress(desc: str, done: int, total: int) -> None:
        run_console = console.active()
        if run_console is not None:  # `llmpipe run`: its stage line shows it, the UI a progress artifact
            run_console.progress(desc, done, total)
        elif sys.stderr.isatty():  # a terminal gets a progress bar, the UI a progress artifact
            from tqdm import tqdm

            bar = bars.get(desc) or bars.setdefault(desc, tqdm(total=total, desc=f"{stage}: {desc}", leave=False))
            bar.update(done - bar.n)
        now = time.monotonic()
        if total and (now - last[0] > 1.0 or done >= total):
            last[0] = now
            update_progress_artifact(progress_id, progress=100.0 * done / total, description=f"{stage}: {desc}")

    with console.stage_output(stage):  # `llmpipe run`: everything the stage prints goes to its log file
        executor = make_executor(cfg)
        try:
            art, ran, seconds = execute(cfg, store, ps, arts, executor=executor, logger=logger,
                                        on_progress=on_progress)
        finally:
            if hasattr(executor, "close"):  # a Dask client: its connection to the scheduler
                executor.close()
    for bar in bars.values():
        bar.close()
    update_progress_artifact(progress_id, progress=100.0)
    logger.info("%s: %s in %.2fs -> %s", stage, "computed" if ran else "reused", seconds, art.path)
    return {"stage": stage, "key": key, "path": str(art.path), "ran": ran, "seconds": round(seconds, 3),
            "stats": art.stats}


def stage_task_for(cfg: PipelineConfig) -> Any:
    """``run_stage`` with its results persisted under the store (so the cache survives processes)."""
    results = Path(open_store(cfg).local) / RESULTS_DIR
    results.mkdir(parents=True, exist_ok=True)
    return run_stage.with_options(result_storage=results)  # a Path: no server-side block needed


def stage_reports(art: Artifact) -> list[dict[str, Any]]:
    """The reports (tables, markdown, images) a stage wrote into its artifact."""
    path = Path(art.path) / REPORTS
    return json.loads(path.read_text()) if path.is_file() else []


def report_key(stage: str, report: dict[str, Any]) -> str:
    return _slug(f"{stage}-{report['key']}")


def _origin(art: Artifact) -> str:
    """Written into each report's description: which artifact the UI's latest version shows."""
    return f"{art.stage} {art.key[:12]}"


def publish_reports(art: Artifact, stage: str) -> None:
    """Show a stage's tables, markdown and charts on the flow run."""
    for rep in stage_reports(art):
        key = report_key(stage, rep)
        description = f"{rep['title']} ({_origin(art)})"
        if rep["kind"] == "table" and rep["payload"]:
            create_table_artifact(table=rep["payload"], key=key, description=description)
        elif rep["kind"] == "stats" and rep["payload"]:  # measurements: values from the manifest
            create_table_artifact(table=stats_rows(art.stats, rep["payload"]), key=key, description=description)
        elif rep["kind"] == "markdown":
            create_markdown_artifact(markdown=rep["payload"], key=key, description=description)
        elif rep["kind"] == "stats-table" and art.stats.get(rep["payload"]):
            create_table_artifact(table=art.stats[rep["payload"]], key=key, description=description)
        elif rep["kind"] == "stats-markdown" and art.stats.get(rep["payload"]):
            create_markdown_artifact(markdown=art.stats[rep["payload"]], key=key, description=description)
        elif rep["kind"] == "image":
            img = Path(art.path) / rep["payload"]
            if img.is_file() and img.stat().st_size < 2_000_000:
                url = "data:image/png;base64," + base64.b64encode(img.read_bytes()).decode()
                create_image_artifact(image_url=url, key=key, description=description)


def report_keys(arts: list[Artifact]) -> list[str]:
    """The artifact keys of every report these stage artifacts hold."""
    return [report_key(a.stage, rep) for a in arts for rep in stage_reports(a)]


def link_cached_reports(cached: list[Artifact], flow: str, latest: dict[str, str] | None = None) -> None:
    """One markdown artifact that points at the reports of the stages this run reused.

    Re-creating every report of every reused stage would cost one API call per report on each
    rerun (20 on the tiny DAG, about a second of a no-change rerun). The reports are keyed artifacts,
    so their latest version is one click away; one query finds the keys whose latest version on
    this server is not from the reused artifact (a fresh server, or the stage last ran with other
    settings), and only those are published again. ``latest``: that query's answer, when the caller
    asked it earlier (keys missing from it count as not published).
    """
    from prefect.settings import get_current_settings

    wanted = {report_key(a.stage, rep): a for a in cached for rep in stage_reports(a)}
    latest = latest_descriptions(list(wanted)) if latest is None else latest
    for art in {a.stage: a for k, a in wanted.items() if _origin(a) not in latest.get(k, "")}.values():
        publish_reports(art, art.stage)
    ui = (get_current_settings().ui_url or "").rstrip("/")
    links = {k: f"[{k}]({ui}/artifacts/key/{k})" if ui else f"`{k}`" for k in wanted}
    rows = [f"| {a.stage} | `{a.key[:12]}` | {', '.join(links[k] for k, b in wanted.items() if b is a) or '-'} |"
            for a in cached]
    create_markdown_artifact(
        markdown=f"**{len(cached)} stage(s) reused from the store.** Their reports, as published when they "
                 f"were computed (each report's description names the artifact it shows):\n\n"
                 "| stage | key | reports |\n|---|---|---|\n" + "\n".join(rows),
        key=f"{flow.replace('_', '-')}-reused", description=f"{flow}: stages reused from the store, their reports")


def latest_descriptions(keys: list[str]) -> dict[str, str]:
    """Artifact key -> description of its latest version on the server (one API call)."""
    if not keys:
        return {}
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=keys)), limit=len(keys))
    return {c.key: c.description or "" for c in found}


def _slug(s: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in s.lower())
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")[:60]
