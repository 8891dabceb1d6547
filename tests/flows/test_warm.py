"""The warm runner of ``llmpipe server``: real server, real runner process, real ``llmpipe run`` clients."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows import ops, warm
from llmpipe.ops import free_port
from tests.conftest import ROOT, write_jsonl

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not warm.supported(), reason="the warm runner needs POSIX fd passing")]
LLMPIPE = str(Path(sys.executable).parent / "llmpipe")
WARM = "running in the warm runner"


class WarmServer:
    def __init__(self, root: Path, env: dict[str, str], runner: ops.ManagedProcess) -> None:
        self.root, self.env, self.runner = root, env, runner

    def run(self, tmp: Path, *extra: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
            config: str = str(ROOT / "configs" / "tiny.yaml")) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.cmd(tmp, *extra, config=config), cwd=cwd, env=env or self.env,
                              capture_output=True, text=True, timeout=600)

    def cmd(self, tmp: Path, *extra: str, config: str = str(ROOT / "configs" / "tiny.yaml")) -> list[str]:
        return [LLMPIPE, "run", config, "--until", "quality", f"store={tmp / 'store'}",
                f"state_dir={self.root / 'state'}", "runner.workers=1",
                f"sources=[{{name: web, path: {tmp / 'corpus'}}}]", *extra]


@pytest.fixture(scope="module")
def warm_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("warm")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("# imported at start by every process of these tests\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTHON", "LLMPIPE_"))}
    env.update(PYTHONPATH=str(site), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    server = ops.start_server(root / "state", port=free_port(), timeout=180, log_path=root / "server.log")
    runner = ops.start_warm_runner(root / "state", env=env)
    assert runner is not None
    try:
        yield WarmServer(root, env, runner)
    finally:
        for proc in (runner, server):
            proc.stop(grace=10)
        leaked = {p.name: p.leftovers() for p in (runner, server) if p.leftovers()}
        assert not leaked, f"processes left running: {leaked}"


def _corpus(tmp: Path, n: int = 40, words: int = 30) -> None:
    write_jsonl(tmp / "corpus" / "part-0.jsonl",
                [{"text": f"Document {i} is about rivers and the bridges people cross every day. " * words}
                 for i in range(n)])


def _states(stdout: str) -> dict[str, str]:
    rows = [ln.split() for ln in stdout.splitlines() if ln.split()[:1] and ln.split()[0] in ("ingest", "langid", "quality")]
    return {r[0]: r[3] for r in rows}


def _run_pid(stderr: str) -> int:
    line = next(ln for ln in stderr.splitlines() if WARM in ln)
    return int(line.rsplit("pid ", 1)[1].rstrip(")"))


def test_runs_fork_from_the_warm_runner_with_the_callers_stdio_and_directory(warm_server, tmp_path: Path) -> None:
    _corpus(tmp_path)
    shutil.copy(ROOT / "configs" / "tiny.yaml", tmp_path / "mine.yaml")
    cold = warm_server.run(tmp_path, cwd=tmp_path, config="mine.yaml")  # relative: the client's directory counts
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert WARM in cold.stderr
    assert psutil.Process(warm_server.runner.pid).is_running()
    assert _run_pid(cold.stderr) != warm_server.runner.pid
    assert _states(cold.stdout) == {"ingest": "Completed", "langid": "Completed", "quality": "Completed"}
    assert "Beginning flow run" in cold.stderr  # Prefect's own logs reach the caller's stderr

    again = warm_server.run(tmp_path, cwd=tmp_path, config="mine.yaml")
    assert again.returncode == 0 and WARM in again.stderr
    assert set(_states(again.stdout).values()) == {"Cached"}

    direct = warm_server.run(tmp_path, "--no-warm", cwd=tmp_path, config="mine.yaml")
    assert direct.returncode == 0 and WARM not in direct.stderr
    assert set(_states(direct.stdout).values()) == {"Cached"}


def test_errors_and_exit_codes_come_back(warm_server, tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    bad = warm_server.run(tmp_path)  # an empty source folder is found while planning, in the run
    assert WARM in bad.stderr
    assert bad.returncode == 2
    assert "holds no readable files" in bad.stderr


def test_other_settings_or_interpreter_run_here(warm_server, tmp_path: Path) -> None:
    _corpus(tmp_path)
    for extra, why in (({"PYTHONWARNINGS": "default"}, "other PYTHON* variables"),
                       ({"PREFECT_TASKS_DEFAULT_RETRIES": "3"}, "Prefect settings differ here: tasks")):
        r = warm_server.run(tmp_path, env={**warm_server.env, **extra})
        assert r.returncode == 0, r.stderr[-3000:]
        assert WARM not in r.stderr and f"warm runner not used ({why}" in r.stderr


def _start_long_run(warm_server: WarmServer, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A client whose run is inside ingest (half-written shards on disk); (client, run pid)."""
    _corpus(tmp_path, n=60_000, words=8)
    err = tmp_path / "client.err"
    with open(err, "wb") as f:
        client = subprocess.Popen(warm_server.cmd(tmp_path), cwd=ROOT, env=warm_server.env, stdout=subprocess.DEVNULL,
                                  stderr=f, start_new_session=True)
    ingest = tmp_path / "store" / "ingest"
    deadline = time.time() + 120
    while time.time() < deadline and client.poll() is None:
        if ingest.is_dir() and any(ingest.rglob(".tmp-*")):
            break
        time.sleep(0.05)
    assert client.poll() is None, f"the run ended before the signal: {err.read_text()[-2000:]}"
    return client, _run_pid(err.read_text())


def _gone(pid: int, within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                time.sleep(0.1)
                continue
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_ctrl_c_reaches_the_run_and_its_exit_code_comes_back(warm_server, tmp_path: Path) -> None:
    client, run = _start_long_run(warm_server, tmp_path)
    client.send_signal(signal.SIGINT)  # the client forwards it to the run's process group
    assert client.wait(timeout=60) == 130  # the run's KeyboardInterrupt; a client killed by it would be -2
    assert _gone(run, within=30)
    assert not _published(tmp_path)


def _published(tmp: Path) -> list[Path]:
    return [p for p in (tmp / "store" / "ingest").iterdir() if not p.name.startswith((".", "_"))]


def test_a_killed_client_takes_its_run_with_it(warm_server, tmp_path: Path) -> None:
    client, run = _start_long_run(warm_server, tmp_path)
    client.kill()
    client.wait()
    assert _gone(run, within=warm.KILL_GRACE_S + 20)
    assert not _published(tmp_path)  # stopped mid-ingest, not left to finish on its own
    assert psutil.Process(warm_server.runner.pid).is_running()


def test_changed_code_is_never_run_warm_and_the_runner_restarts(warm_server, tmp_path: Path) -> None:
    """Last in this module: it restarts the runner. Any imported file that changes counts."""
    _corpus(tmp_path)
    info = warm_server.root / "state" / "prefect" / warm.INFO_FILE
    started = json.loads(info.read_text())["started"]
    custom = warm_server.root / "site" / "sitecustomize.py"
    custom.write_text(custom.read_text() + "# changed\n")
    stale = warm_server.run(tmp_path)
    assert stale.returncode == 0 and WARM not in stale.stderr
    assert "sitecustomize.py changed since the warm runner started" in stale.stderr
    deadline = time.time() + 120
    while time.time() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(info.read_text())["started"] > started:
                break
        time.sleep(0.2)
    fresh = warm_server.run(tmp_path)
    assert fresh.returncode == 0 and WARM in fresh.stderr
    assert warm_server.runner.alive()  # execv: the same process, now with the new code


def test_stale_module_names_the_changed_file(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    snap = {str(f): (f.stat().st_mtime_ns, f.stat().st_size)}
    assert warm.stale_module(snap) is None
    f.write_text("x = 22\n")
    assert warm.stale_module(snap) == str(f)
    f.unlink()
    assert warm.stale_module(snap) == str(f)


def test_llmpipe_server_starts_the_runner_and_sigterm_stops_everything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LLMPIPE_"))}
    state = tmp_path / "state"
    server = subprocess.Popen([LLMPIPE, "server", "--state-dir", str(state), "--port", str(free_port())], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in server.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("next:"):
                break
        assert any(ln.startswith("warm runner: `llmpipe run` starts in its pid") for ln in lines), lines
        children = psutil.Process(server.pid).children(recursive=True)
        assert len(children) >= 2  # the Prefect server and the warm runner, each in its own session
        sock = json.loads((state / "prefect" / warm.INFO_FILE).read_text())["socket"]
        assert Path(sock).exists()
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) is not None
    assert all(_gone(c.pid, within=5) for c in children)
    assert not (state / "prefect" / warm.INFO_FILE).exists() and not Path(sock).exists()
    assert not (state / "prefect" / "server.json").exists()
