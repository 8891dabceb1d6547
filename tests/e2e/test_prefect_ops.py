"""The ops harness on small flows: deploy with a schedule in a chosen time zone, run a deployment from
the ``prefect`` CLI through the worker, and get a webhook call when a run fails (the alert example)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from flows import prefect_ops
from llmpipe.processes import free_port

pytestmark = pytest.mark.slow
HELLO = Path(__file__).resolve().parent / "assets" / "prefect-hello.yaml"


def test_deploy_registers_schedule_in_timezone(prefect_stack) -> None:
    names = prefect_stack.deploy(HELLO, timezone="Europe/Paris", cron="30 3 * * *")
    assert sorted(names) == ["always-fails/smoke", "hello/smoke"]
    deps = prefect_stack.deployments()
    (sched,) = deps["hello/smoke"].schedules
    assert (sched.schedule.cron, sched.schedule.timezone, sched.active) == ("30 3 * * *", "Europe/Paris", True)
    assert deps["always-fails/smoke"].schedules == []
    assert deps["hello/smoke"].work_pool_name == prefect_ops.WORK_POOL
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        prefect_stack.deploy(HELLO, timezone="Mars/Olympus")


def test_cli_deployment_run_completes(prefect_stack, tmp_path: Path) -> None:
    out = tmp_path / "hello.txt"
    cmd = [sys.executable, "-m", "prefect", "deployment", "run", "hello/smoke",
           "--param", f"out={json.dumps(str(out))}", "--param", 'text="from the CLI"']
    r = subprocess.run(cmd, env=prefect_stack.cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    run_id = next(line.split()[-1] for line in r.stdout.splitlines() if "UUID" in line)
    run = prefect_stack.wait(run_id, timeout=300)
    assert run.state.type.value == "COMPLETED", prefect_stack.logs()
    assert out.read_text() == "from the CLI"


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_failed_run_calls_alert_webhook(prefect_stack) -> None:
    port = free_port()
    hook = ThreadingHTTPServer(("127.0.0.1", port), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    try:
        prefect_ops.create_failure_alert(f"http://127.0.0.1:{port}/alert", state_dir=prefect_stack.state_dir,
                                 api_url=prefect_stack.api_url)
        if "always-fails/smoke" not in prefect_stack.deployments():
            prefect_stack.deploy(HELLO)
        run = prefect_stack.trigger("always-fails/smoke", {"reason": "planted failure"}, timeout=300)
        assert run.state.type.value == "FAILED", prefect_stack.logs()
        deadline = time.monotonic() + 90
        while not _Hook.received and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _Hook.received, "the failure automation did not call the webhook within 90 s\n" + prefect_stack.logs()
        alert = _Hook.received[0]
        assert alert["flow_run_id"] == str(run.id) and alert["state"] == "Failed"
        assert alert["url"].startswith(prefect_stack.ui_url)
    finally:
        hook.shutdown()
