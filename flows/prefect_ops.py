"""Operations commands: a local Prefect server, a process worker, deployment registration, runs.

These are the functions behind ``llmpipe server``, ``llmpipe worker`` and ``llmpipe deploy`` (wired
in ``flows/cli.py``), and the helpers the end-to-end tests use. Server and worker run as
:class:`llmpipe.ops.ManagedProcess` so that they can be stopped reliably (a background Prefect worker
ignores the first SIGTERM).

Which server? ``PREFECT_API_URL`` when set; otherwise the one ``llmpipe server`` started for this
project (it records its address in ``<state_dir>/prefect/server.json``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmpipe.processes import ManagedProcess, guard, run_foreground, wait_for_http

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PREFECT_FILE = PROJECT_ROOT / "deployments" / "prefect.yaml"
WORK_POOL = "llmpipe-process"
DEPLOY_DEFAULTS = {
    "LLMPIPE_TIMEZONE": "UTC",
    "LLMPIPE_CONFIG": "configs/tiny.yaml",
    "LLMPIPE_WORK_POOL": WORK_POOL,
    "LLMPIPE_NIGHTLY_CRON": "0 2 * * *",
}
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


# -- where things live ------------------------------------------------------------------------------
def prefect_home(state_dir: str | Path = ".llmpipe") -> Path:
    """Prefect's own state (SQLite database, profiles, logs) for this project."""
    return Path(state_dir).resolve() / "prefect"


def _server_file(state_dir: str | Path) -> Path:
    return prefect_home(state_dir) / "server.json"


def resolve_api_url(state_dir: str | Path = ".llmpipe", api_url: str | None = None) -> str:
    """The Prefect API to talk to: explicit > ``PREFECT_API_URL`` > the server ``llmpipe server`` started."""
    if api_url:
        return api_url.rstrip("/")
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"].rstrip("/")
    f = _server_file(state_dir)
    if f.exists():
        return str(json.loads(f.read_text())["api_url"]).rstrip("/")
    raise RuntimeError(
        f"no Prefect server known: start one with `llmpipe server` (records {f}) or set PREFECT_API_URL"
    )


def prefect_env(state_dir: str | Path = ".llmpipe", api_url: str | None = None,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a Prefect child process of this project (server, worker, CLI)."""
    env = dict(os.environ)
    env.setdefault("PREFECT_HOME", str(prefect_home(state_dir)))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("PREFECT_CLI_COLORS", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(extra or {})
    return env


def _prefect_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


# -- server -----------------------------------------------------------------------------------------
def start_server(
    state_dir: str | Path = ".llmpipe",
    host: str = "127.0.0.1",
    port: int = 4200,
    *,
    log_path: str | Path | None = None,
    timeout: float = 120.0,
    extra_env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """Start ``prefect server start`` in the background, wait until healthy, record its address.

    The database is SQLite under ``<state_dir>/prefect`` unless ``PREFECT_API_DATABASE_CONNECTION_URL``
    says otherwise. Returns the running process; ``.stop()`` it (or use it as a context manager).
    """
    home = prefect_home(state_dir)
    home.mkdir(parents=True, exist_ok=True)
    env = prefect_env(state_dir, extra=extra_env)
    env["PREFECT_HOME"] = env.get("PREFECT_HOME") or str(home)
    env.pop("PREFECT_API_URL", None)  # the server must not point at another server
    env["PREFECT_SERVER_API_HOST"], env["PREFECT_SERVER_API_PORT"] = host, str(port)
    env.setdefault("PREFECT_UI_URL", f"http://{host}:{port}")  # links in alerts and logs
    proc = ManagedProcess(_prefect_cmd("server", "start", "--host", host, "--port", str(port)),
                          log_path or home / "server.log", env=env, name="prefect-server")
    proc.start()
    base = f"http://{host}:{port}"
    try:
        wait_for_http(f"{base}/api/health", timeout=timeout, proc=proc)
    except BaseException:
        proc.stop()
        raise
    _server_file(state_dir).write_text(json.dumps(
        {"api_url": f"{base}/api", "ui_url": base, "pid": proc.pid, "log": str(proc.log_path)}, indent=1))
    return proc


def server(state_dir: str | Path = ".llmpipe", host: str = "127.0.0.1", port: int = 4200) -> int:
    """``llmpipe server``: a local Prefect server until Ctrl-C; prints the UI address.

    SIGTERM and SIGHUP stop it like Ctrl-C: the server runs in a session of its own, so it would
    outlive a ``llmpipe server`` that died without stopping it.
    """
    import signal

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    proc = start_server(state_dir, host, port)
    try:
        print(f"Prefect UI: http://{host}:{port}", flush=True)
        print(f"API: http://{host}:{port}/api   state: {prefect_home(state_dir)}   log: {proc.log_path}", flush=True)
        print("next: `llmpipe deploy` and `llmpipe worker` in other terminals; Ctrl-C stops the server", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return proc.stop() or 0
    finally:
        proc.stop()
        _server_file(state_dir).unlink(missing_ok=True)


# -- work pool, deployments -------------------------------------------------------------------------
def _run_cli(args: Sequence[str], env: Mapping[str, str], cwd: Path, what: str, timeout: float) -> str:
    guard()  # the `prefect` child ends with this process even if it is killed
    r = subprocess.run(_prefect_cmd(*args), env=dict(env), cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {r.returncode}): prefect {' '.join(args)}\n"
                           f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r.stdout


def ensure_work_pool(pool: str = WORK_POOL, *, pool_type: str = "process", state_dir: str | Path = ".llmpipe",
                     api_url: str | None = None) -> None:
    """Create the work pool if it does not exist (deployments must name an existing pool)."""
    url = resolve_api_url(state_dir, api_url)
    env = prefect_env(state_dir, url)
    guard()
    probe = subprocess.run(_prefect_cmd("work-pool", "inspect", pool), env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    if probe.returncode == 0:
        return
    try:
        _run_cli(["work-pool", "create", pool, "--type", pool_type], env, PROJECT_ROOT,
                 f"creating work pool {pool!r}", 120)
    except RuntimeError as e:
        if "already exists" not in str(e):  # a worker may have created it meanwhile
            raise


def deploy(
    prefect_file: str | Path = PREFECT_FILE,
    *,
    names: Sequence[str] = (),
    pool: str | None = None,
    timezone: str | None = None,
    config: str | None = None,
    cron: str | None = None,
    state_dir: str | Path = ".llmpipe",
    api_url: str | None = None,
    project_dir: str | Path = PROJECT_ROOT,
) -> list[str]:
    """``llmpipe deploy``: create the work pool and register the deployments of ``prefect_file``.

    ``names`` limits it to some deployments (``flow-name/deployment``); ``timezone``, ``config``,
    ``cron`` and ``pool`` fill the ``{{ $LLMPIPE_* }}`` values of the file. Returns the registered
    deployment names as ``flow/deployment``.
    """
    url = resolve_api_url(state_dir, api_url)
    values = {k: os.environ.get(k, v) for k, v in DEPLOY_DEFAULTS.items()}
    for key, val in (("LLMPIPE_TIMEZONE", timezone), ("LLMPIPE_CONFIG", config),
                     ("LLMPIPE_NIGHTLY_CRON", cron), ("LLMPIPE_WORK_POOL", pool)):
        if val:
            values[key] = val
    _check_timezone(values["LLMPIPE_TIMEZONE"])
    ensure_work_pool(values["LLMPIPE_WORK_POOL"], state_dir=state_dir, api_url=url)
    prefect_file = Path(prefect_file).resolve()
    if not prefect_file.exists():
        raise FileNotFoundError(f"deployments file not found: {prefect_file}")
    args = ["deploy", "--prefect-file", str(prefect_file), "--no-prompt"]
    args += [a for n in names for a in ("--name", n)] if names else ["--all"]
    out = _run_cli(args, prefect_env(state_dir, url, values), Path(project_dir), "prefect deploy", 600)
    return re.findall(r"Deployment '([^']+)' successfully", out)


def _check_timezone(tz: str) -> None:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise ValueError(f"LLMPIPE_TIMEZONE / --timezone: unknown time zone {tz!r} ({e})") from None


# -- worker -----------------------------------------------------------------------------------------
def start_worker(
    pool: str = WORK_POOL,
    *,
    state_dir: str | Path = ".llmpipe",
    api_url: str | None = None,
    name: str | None = None,
    limit: int | None = None,
    log_path: str | Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """Start a process worker polling ``pool`` in the background (stop it with ``.stop()``)."""
    url = resolve_api_url(state_dir, api_url)
    args = ["worker", "start", "--pool", pool, "--type", "process", "--install-policy", "never"]
    if name:
        args += ["--name", name]
    if limit:
        args += ["--limit", str(limit)]
    env = prefect_env(state_dir, url, extra_env)
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", "2")
    log = log_path or prefect_home(state_dir) / f"worker-{pool}.log"
    return ManagedProcess(_prefect_cmd(*args), log, env=env, cwd=PROJECT_ROOT, name=f"worker:{pool}").start()


def worker(pool: str = WORK_POOL, *, state_dir: str | Path = ".llmpipe", api_url: str | None = None,
           limit: int | None = None) -> int:
    """``llmpipe worker``: run a process worker in the foreground until Ctrl-C (or SIGTERM, SIGHUP).

    The worker runs in a session of its own: the first two signals are passed on to it, a third
    one, or 10 s after the first, kills it and its flow runs, and if this command is killed its
    watchdog ends them (:func:`llmpipe.processes.run_foreground`).
    """
    url = resolve_api_url(state_dir, api_url)
    args = ["worker", "start", "--pool", pool, "--type", "process", "--install-policy", "never"]
    if limit:
        args += ["--limit", str(limit)]
    print(f"worker on pool {pool!r} -> {url}", flush=True)
    return run_foreground(_prefect_cmd(*args), env=prefect_env(state_dir, url), cwd=PROJECT_ROOT)


# -- runs (Python API, against the chosen server) ---------------------------------------------------
@contextmanager
def prefect_api(state_dir: str | Path = ".llmpipe", api_url: str | None = None) -> Iterator[str]:
    """Point this process's Prefect client at the server (settings are read once, so set them here)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = resolve_api_url(state_dir, api_url)
    with temporary_settings({PREFECT_API_URL: url}):
        yield url


def trigger(name: str, parameters: Mapping[str, Any] | None = None, *, wait: bool = True,
            timeout: float = 3600.0, state_dir: str | Path = ".llmpipe", api_url: str | None = None) -> Any:
    """Start a run of deployment ``flow/deployment``; with ``wait`` return it in a final state."""
    from prefect.deployments import run_deployment

    with prefect_api(state_dir, api_url):
        run = run_deployment(name, parameters=dict(parameters or {}), timeout=0, as_subflow=False)
    return wait_for_flow_run(run.id, timeout=timeout, state_dir=state_dir, api_url=api_url) if wait else run


def wait_for_flow_run(flow_run_id: Any, *, timeout: float = 3600.0, poll: float = 1.0,
                      state_dir: str | Path = ".llmpipe", api_url: str | None = None) -> Any:
    """Poll a flow run until it is Completed/Failed/Crashed/Cancelled; TimeoutError names its last state."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with prefect_api(state_dir, api_url), get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.type.value in TERMINAL:
                return run
            if time.monotonic() > deadline:
                state = run.state.name if run.state else "no state"
                raise TimeoutError(f"flow run {run.name} ({flow_run_id}) still {state} after {timeout:.0f}s")
            time.sleep(poll)


def list_deployments(*, state_dir: str | Path = ".llmpipe", api_url: str | None = None) -> dict[str, Any]:
    """Registered deployments by ``flow/deployment`` name."""
    from prefect.client.orchestration import get_client

    with prefect_api(state_dir, api_url), get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {f"{flows.get(d.flow_id, '?')}/{d.name}": d for d in client.read_deployments()}


def create_failure_alert(webhook_url: str, *, name: str = "llmpipe-failed-runs", tags: Sequence[str] = ("llmpipe",),
                         state_dir: str | Path = ".llmpipe", api_url: str | None = None) -> Any:
    """An automation that POSTs to ``webhook_url`` when a flow run of a deployment tagged ``tags`` fails.

    The webhook is saved as a Prefect ``Webhook`` block named ``<name>-webhook``. Re-running replaces
    the automation of the same name. The payload is JSON with the flow run's name, id, state and a UI link.
    """
    from prefect.automations import Automation
    from prefect.blocks.webhook import Webhook
    from prefect.events.actions import CallWebhook
    from prefect.events.schemas.automations import EventTrigger, Posture

    payload = json.dumps({
        "text": "llmpipe: flow run {{ flow_run.name }} is {{ flow_run.state.name }}",
        "flow_run_id": "{{ flow_run.id }}", "flow_run": "{{ flow_run.name }}",
        "state": "{{ flow_run.state.name }}", "url": "{{ flow_run|ui_url }}",
    })
    with prefect_api(state_dir, api_url):
        block = Webhook(url=webhook_url, method="POST", allow_private_urls=True)
        block_id = block.save(f"{name}-webhook", overwrite=True)
        try:
            Automation.read(name=name).delete()
        except ValueError:
            pass
        automation = Automation(
            name=name,
            description="Alert when an llmpipe flow run fails or crashes",
            trigger=EventTrigger(
                expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related={"prefect.resource.role": "tag", "prefect.resource.id": [f"prefect.tag.{t}" for t in tags]},
                posture=Posture.Reactive, threshold=1, within=0,
            ),
            actions=[CallWebhook(block_document_id=block_id, payload=payload)],
        )
        return automation.create()
