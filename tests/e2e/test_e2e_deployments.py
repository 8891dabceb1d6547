"""The real deployments (deployments/prefect.yaml) on a real Prefect server and process worker:
(a) the nightly data refresh triggered from the ``prefect`` CLI runs to Completed and fills the store;
(b) the same deployment triggered from the Prefect UI in headless Chromium (Run -> Quick run)
completes, every stage reused from the store when (a) ran first; a screenshot goes to tests/e2e/_outputs/."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows import prefect_ops
from tests.e2e.conftest import OUTPUTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
EXPECTED = {"data-refresh/nightly", "lifecycle/default", "pretrain/default", "release/default"}
NIGHTLY = "data-refresh/nightly"


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/tiny.yaml with its store and state in a tmp dir (relative source paths made absolute)."""
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    root = tmp_path_factory.mktemp("tiny")
    data["store"], data["state_dir"] = str(root / "store"), str(root / "state")
    for src in data.get("sources", []):
        path = str(src.get("path", ""))
        if ":" not in path and not Path(path).is_absolute():
            src["path"] = str((ROOT / "configs" / path).resolve())
    out = root / "tiny-e2e.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def deployed(prefect_stack, tiny_config: Path) -> list[str]:
    return prefect_stack.deploy(config=str(tiny_config))


def test_deployments_registered_with_defaults(prefect_stack, deployed: list[str], tiny_config: Path) -> None:
    assert set(deployed) == EXPECTED
    deps = prefect_stack.deployments()
    assert EXPECTED <= set(deps)
    for name in EXPECTED:
        d = deps[name]
        assert d.parameters["config"] == str(tiny_config) and d.parameters["overrides"] == [], name
        schema = d.parameter_openapi_schema
        assert not schema.get("required"), f"{name}: parameters without a default: {schema.get('required')}"
        assert d.work_pool_name == prefect_ops.WORK_POOL
    (sched,) = deps[NIGHTLY].schedules
    assert (sched.schedule.cron, sched.schedule.timezone) == ("0 2 * * *", "UTC")
    assert all(not deps[n].schedules for n in EXPECTED - {NIGHTLY})


def _stage_rows(prefect_stack, flow_run_id: Any) -> list[dict[str, Any]]:
    """The flow's stage table artifact (stage, key, cached/ran) for one flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with prefect_ops.prefect_api(prefect_stack.state_dir, prefect_stack.api_url), get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    tables = [a for a in arts if a.type == "table" and (a.key or "").endswith("-stages")]
    assert tables, f"no stage table artifact on flow run {flow_run_id}: {[a.key for a in arts]}"
    data = tables[0].data
    return json.loads(data) if isinstance(data, str) else data


def _data_refresh_stages(tiny_config: Path) -> dict[str, str]:
    from llmpipe.config import load_config
    from llmpipe.dag import plan, select

    cfg = load_config(tiny_config)
    return {ps.name: ps.key for ps in select(plan(cfg), "data_refresh", None, None)}


def test_a_cli_run_of_nightly_refresh_completes(prefect_stack, deployed: list[str], tiny_config: Path) -> None:
    cmd = [sys.executable, "-m", "prefect", "deployment", "run", NIGHTLY]
    r = subprocess.run(cmd, env=prefect_stack.cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", r.stdout).group(1)
    run = prefect_stack.wait(run_id, timeout=900)
    assert run.state.type.value == "COMPLETED", f"{run.state}\n{prefect_stack.logs()}"
    rows = _stage_rows(prefect_stack, run.id)
    expected = _data_refresh_stages(tiny_config)
    assert [r["stage"] for r in rows] == list(expected)
    assert all(r["status"] == "ran" for r in rows), rows
    missing = [stage for stage, ok in _stored_stages(tiny_config).items() if not ok]
    assert not missing, f"artifacts missing from the store after the run: {missing}"


def _run_ids(prefect_stack, deployment_id: Any, now_only: bool = False) -> set[str]:
    """Flow runs of a deployment; ``now_only`` drops the nightly schedule's future runs."""
    from datetime import datetime, timedelta, timezone

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    soon = datetime.now(timezone.utc) + timedelta(minutes=10)
    with prefect_ops.prefect_api(prefect_stack.state_dir, prefect_stack.api_url), get_client(sync_client=True) as c:
        runs = c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    return {str(r.id) for r in runs
            if not now_only or r.expected_start_time is None or r.expected_start_time < soon}


def _new_run(prefect_stack, deployment_id: Any, before: set[str], timeout: float = 30) -> str:
    """The one flow run the UI click created (a double click would show as two)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = _run_ids(prefect_stack, deployment_id, now_only=True) - before
        if new:
            time.sleep(2)  # let a duplicate show up if the click fired twice
            new = _run_ids(prefect_stack, deployment_id, now_only=True) - before
            assert len(new) == 1, f"Quick run created {len(new)} runs: {new}"
            return new.pop()
        time.sleep(0.5)
    raise AssertionError(f"no flow run appeared within {timeout:.0f}s of clicking Quick run")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (scripts/install.sh installs it)")
def test_b_ui_quick_run_completes(prefect_stack, deployed: list[str], tiny_config: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    dep = prefect_stack.deployments()[NIGHTLY]
    OUTPUTS.mkdir(parents=True, exist_ok=True)
    shot = OUTPUTS / "ui-quick-run-data-refresh.png"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(60_000)
            page.goto(f"{prefect_stack.ui_url}/deployments/deployment/{dep.id}")
            stored = _stored_stages(tiny_config)  # after test (a): everything; alone: nothing
            before = _run_ids(prefect_stack, dep.id)
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Quick run", exact=True).click()
            run_id = _new_run(prefect_stack, dep.id, before)
            t0 = time.monotonic()
            run = prefect_stack.wait(run_id, timeout=600)
            seconds = time.monotonic() - t0
            page.goto(f"{prefect_stack.ui_url}/runs/flow-run/{run_id}")
            page.get_by_text("Completed").first.wait_for()
            page.get_by_text(re.compile(r"Beginning flow run")).first.wait_for()  # the worker's logs are in
            page.screenshot(path=str(shot), full_page=True)
            page.get_by_role("tab", name="Artifacts").or_(page.get_by_text("Artifacts", exact=True)).first.click()
            page.get_by_text("data-refresh-stages").first.wait_for()
            page.screenshot(path=str(OUTPUTS / "ui-quick-run-artifacts.png"), full_page=True)
        finally:
            browser.close()
    print(f"\nUI quick run: flow run {run_id} {run.state.name} in ~{seconds:.0f}s; screenshot {shot}")
    assert run.deployment_id == dep.id
    assert run.state.type.value == "COMPLETED", f"{run.state}\n{prefect_stack.logs()}"
    assert shot.stat().st_size > 10_000
    rows = _stage_rows(prefect_stack, run.id)
    assert {r["stage"]: r["status"] for r in rows} == {s: "cached" if ok else "ran" for s, ok in stored.items()}


def _stored_stages(tiny_config: Path) -> dict[str, bool]:
    from llmpipe.config import load_config
    from llmpipe.dag import open_store

    store = open_store(load_config(tiny_config))
    return {stage: store.get(stage, key) is not None for stage, key in _data_refresh_stages(tiny_config).items()}
