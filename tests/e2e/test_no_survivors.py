"""Nothing outlives the run: kill an ``llmpipe`` command while its children are up, find none of them alive.

Each case starts the real command (the console script) in a process group of its own, notes every
descendant by pid (psutil) while it runs until the child of interest is up, signals the command
(SIGKILL to its whole group, SIGTERM to it alone, SIGINT to its group as a terminal's Ctrl-C does),
and asserts that the command ended and that none of the processes noted is running
``SURVIVOR_S`` seconds later (a zombie counts as ended: it holds no port and no memory).

The children of interest: ``tritonserver`` and its Python-backend stub (``llmpipe run`` in
``deploy``, ``llmpipe serve``), ``torchrun`` and its workers, each in a session of its own
(``llmpipe run`` in ``pretrain``), Prefect's temporary server (``uvicorn``, a plain child of the
run), the ``prefect worker`` under ``llmpipe worker``, the Prefect server under ``llmpipe server``,
and a Dask LocalCluster's worker processes. The Triton cases also check that the backend's
shared-memory regions (``/dev/shm``, in RAM) do not stay behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from llmpipe.processes import GUARD_GRACE_S, descendants
from tests.conftest import ROOT, link_artifacts, make_run_store

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")]

_SCRIPT = Path(sys.executable).with_name("llmpipe")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "flows.cli"]
SURVIVOR_S = GUARD_GRACE_S + 10  # the watchdog's SIGTERM grace, its SIGKILL, and a loaded machine
# the prepared store's settings (the deploy runs must plan the same keys): as small as the stages allow
PREPARED = ["train.max_steps=4", "train.checkpoint.every=4", "train.launch.nproc_per_node=1",
            "evaluate.max_sequences=8", "evaluate.max_new_tokens=4", "quantize.calibration.samples=8"]
Found = Callable[[list[psutil.Process]], bool]
STARTED: list[int] = []  # pids of the commands this module ran


@pytest.fixture(scope="module", autouse=True)
def sigint_as_at_a_terminal() -> Iterator[None]:
    """The commands start with SIGINT handled, as under a terminal. A test session started in the
    background of a non-interactive shell (``cmd &``, ``nohup``) has SIGINT ignored, which every
    child inherits across exec, and Python then leaves it ignored: a SIGINT case would test the
    shell's choice, not the command's handling."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass
class Command:
    """A command in a process group of its own, and every descendant seen while it ran."""

    argv: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] = field(init=False)
    seen: dict[int, psutil.Process] = field(default_factory=dict)

    def __post_init__(self) -> None:
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        STARTED.append(self.popen.pid)

    @property
    def name(self) -> str:
        return " ".join(self.argv[len(CLI):len(CLI) + 1]) if self.argv[:len(CLI)] == CLI else "python"

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def note(self) -> list[psutil.Process]:
        self.seen.update(descendants(self.popen.pid))
        return [p for p in self.seen.values() if _running(p)]

    def wait_for(self, found: Found, what: str, timeout: float = 240.0) -> None:
        """Note descendants until ``found`` says the child of interest is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found(self.note()):
                time.sleep(0.5)
                self.note()
                return
            if self.popen.poll() is not None:
                pytest.fail(f"{self.name} exited ({self.popen.returncode}) before {what} was up:\n{self.tail()}")
            time.sleep(0.2)
        pytest.fail(f"{what} not up after {timeout:.0f} s:\n{self.tail()}")

    def send(self, *signals: signal.Signals, group: bool | None = None) -> None:
        """By default SIGKILL and SIGINT go to the whole process group, SIGTERM to the command alone."""
        for sig in signals:
            self.note()
            if group or (group is None and sig != signal.SIGTERM):
                os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
            time.sleep(0.3)

    def survivors(self) -> tuple[list[str], float]:
        """Wait for the command to end, then for what it left; what still runs, and the seconds it took."""
        try:
            self.popen.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running 90 s after the signal:\n{self.tail()}")
        ended = time.monotonic()
        left = [p for p in self.seen.values() if _running(p)]
        while left and time.monotonic() - ended < SURVIVOR_S:
            time.sleep(0.2)
            left = [p for p in left if _running(p)]
        return [_describe(p) for p in left], time.monotonic() - ended

    def kill_all(self) -> None:
        """Whatever the outcome, leave nothing behind for the next test."""
        for p in [*self.seen.values()]:
            if _running(p):
                p.kill()
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _describe(p: psutil.Process) -> str:
    return f"{p.pid} {_cmdline(p)[:160]}"


def triton_up(procs: list[psutil.Process]) -> bool:
    """tritonserver and at least one Python-backend stub (its grandchild of interest)."""
    names = [_cmdline(p) for p in procs]
    return any("bin/tritonserver" in c for c in names) and any("triton_python_backend_stub" in c for c in names)


def workers_up(procs: list[psutil.Process]) -> bool:
    """torchrun and its two training workers (sessions of their own, below torchrun)."""
    names = [_cmdline(p) for p in procs]
    return (any("torch.distributed.run" in c for c in names)
            and sum("llmpipe.training.trainer" in c and "torch.distributed.run" not in c for c in names) >= 2)


def temporary_server_up(procs: list[psutil.Process]) -> bool:
    return any("uvicorn" in _cmdline(p) and "prefect.server.api.server" in _cmdline(p) for p in procs)


def prefect_worker_up(procs: list[psutil.Process]) -> bool:
    return any("prefect" in _cmdline(p) and "worker start" in _cmdline(p) for p in procs)


def regions(pid: int | None = None) -> list[str]:
    """Triton Python-backend shared-memory regions of servers started by ``pid`` (by anyone: None)."""
    return sorted(f.name for f in Path("/dev/shm").glob(f"llmpipe_triton_{'' if pid is None else f'{pid}_'}*"))


def _check(cmd: Command, found: Found, what: str, *signals: signal.Signals, group: bool | None = None,
           after_up: Callable[[], None] | None = None) -> None:
    try:
        cmd.wait_for(found, what)
        if after_up is not None:
            after_up()
        cmd.send(*signals, group=group)
        left, seconds = cmd.survivors()
        how = "+".join(s.name for s in signals)
        assert not left, (f"{len(left)} processes outlived `{cmd.name}` ({how}):\n" + "\n".join(left)
                          + f"\n{cmd.tail()}")
        print(f"{cmd.name} with {what} up, {how}: {len(cmd.seen)} processes noted, none running "
              f"{seconds:.1f} s after the command ended")
    finally:
        cmd.kill_all()


# -- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("no-survivors")


@pytest.fixture(scope="module")
def env(root: Path) -> dict[str, str]:
    e = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "HF_HUB_OFFLINE": "1",
         "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    e.pop("PREFECT_API_URL", None)
    return e


@pytest.fixture(scope="module")
def store(root: Path, env: dict[str, str]) -> list[str]:
    """A store filled through ``quantize`` by the real command (tiny config, 4 steps): the run's overrides.
    The data stages' artifacts (ingest..tokenize, what ``make run`` published when CI ran it) are linked
    in first: nothing here kills a run in them, so the command runs pretrain..quantize on them."""
    from llmpipe.config import load_config
    from llmpipe.dag import plan, select

    overrides = [f"store={root / 'store'}", f"state_dir={root / 'state'}"]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [*overrides, *PREPARED])
    data = {ps.name: ps.key for ps in select(plan(cfg), "data_refresh", None, None)}
    made = make_run_store(data, "no-survivors")
    if made is not None:
        link_artifacts(made, root / "store", data)
    r = subprocess.run([*CLI, "run", "configs/tiny.yaml", *overrides, "--no-prefect", "--until", "quantize", *PREPARED],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return overrides


@pytest.fixture(scope="module")
def model_repo(root: Path) -> Path:
    """A Triton model repository on a tiny checkpoint, for ``llmpipe serve``."""
    from llmpipe.serving.config import DeployConfig
    from llmpipe.serving.repository import write_model_repository
    from llmpipe.serving.server import available
    from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint

    if not available():
        pytest.skip("no Triton binary: run scripts/install.sh")
    repo = root / "repo"
    write_model_repository(make_tiny_checkpoint(root / "ckpt"), repo,
                           DeployConfig(model_name="tiny_lm", max_prompt_tokens=48, max_tokens_limit=32), 1)
    return repo


@pytest.fixture(scope="module")
def prefect_server(root: Path, env: dict[str, str]) -> Iterator[tuple[Command, str]]:
    """``llmpipe server`` (a real Prefect server) for ``llmpipe worker``: the command and its API URL.

    The last test of the module kills it."""
    from llmpipe.processes import free_port, wait_for_http

    port = free_port()
    cmd = Command([*CLI, "server", "--state-dir", str(root / "server-state"), "--port", str(port)],
                  root / "server.log", {**env, "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root / 'p.db'}"})
    try:
        wait_for_http(f"http://127.0.0.1:{port}/api/health", timeout=240)
        yield cmd, f"http://127.0.0.1:{port}/api"
    finally:
        cmd.kill_all()


def _run(root: Path, env: dict[str, str], name: str, *args: str) -> Command:
    return Command([*CLI, "run", "configs/tiny.yaml", *args], root / f"{name}.log", env)


# -- llmpipe run ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_run_killed_in_deploy_leaves_no_triton(sig: signal.Signals, store: list[str], root: Path,
                                               env: dict[str, str]) -> None:
    cmd = _run(root, env, f"deploy-{sig.name}", *store, *PREPARED, "--no-prefect", "--from", "deploy")
    _check(cmd, triton_up, "tritonserver and its stub", sig)
    if sig == signal.SIGINT:  # stopped in the process: it removed its server's shared memory too
        assert regions(cmd.popen.pid) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
def test_run_killed_in_pretrain_leaves_no_workers(sig: signal.Signals, store: list[str], root: Path,
                                                  env: dict[str, str]) -> None:
    cmd = _run(root, env, f"pretrain-{sig.name}", *store, "--no-prefect", "--from", "pretrain", "--until", "pretrain",
               "train.max_steps=100000", "train.checkpoint.every=0")
    _check(cmd, workers_up, "torchrun and its workers", sig)
    if sig == signal.SIGINT:  # Ctrl-C: one line and exit 130; the traceback is in the stage's log only
        out = cmd.log.read_text(errors="replace")
        assert cmd.popen.returncode == 130 and "llmpipe: interrupted" in out and "Traceback" not in out, out[-3000:]


def test_run_with_temporary_prefect_server_killed_in_pretrain(store: list[str], root: Path,
                                                              env: dict[str, str]) -> None:
    """SIGKILL for the run alone: Prefect's stop of its temporary server (an exit handler) never runs,
    and uvicorn is a plain child of the run. (On SIGTERM Prefect's engine unwinds the run itself.)"""
    cmd = _run(root, env, "pretrain-prefect-SIGKILL", *store, "--from", "pretrain", "--until", "pretrain",
               "train.max_steps=100000", "train.checkpoint.every=0")
    _check(cmd, lambda ps: temporary_server_up(ps) and workers_up(ps),
           "Prefect's temporary server, torchrun and its workers", signal.SIGKILL, group=False)


# -- llmpipe serve -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_serve_stopped_leaves_no_triton(sig: signal.Signals, model_repo: Path, root: Path,
                                        env: dict[str, str]) -> None:
    from llmpipe.processes import free_ports

    ports = [str(p) for p in free_ports(4)]
    cmd = Command([*CLI, "serve", str(model_repo), "--http-port", ports[0], "--grpc-port", ports[1],
                   "--metrics-port", ports[2], "--api-port", ports[3], "--api-key", "sk-e2e"],
                  root / f"serve-{sig.name}.log", env)

    def no_stale_regions_and_the_api_answers() -> None:
        # a server start removes the regions of starters killed before (deploy tests)
        stale = [r for pid in STARTED if not psutil.pid_exists(pid) for r in regions(pid)]
        assert stale == [], stale
        _openai_client_answers(cmd, ports[3])

    _check(cmd, triton_up, "tritonserver and its stub", sig, after_up=no_stale_regions_and_the_api_answers)
    assert regions(cmd.popen.pid) == []


def _openai_client_answers(cmd: Command, port: str) -> None:
    """``llmpipe serve`` prints its OpenAI API's URL, and the official client gets an answer there."""
    import openai
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while f"OpenAI-compatible API: {url}" not in cmd.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no API line in the output:\n{cmd.tail()}"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=url, api_key="sk-e2e", max_retries=0, timeout=60)
    answer = client.completions.create(model="tiny_lm", prompt="hello", max_tokens=4, temperature=0)
    assert 1 <= answer.usage.completion_tokens <= 4 and answer.choices[0].finish_reason in ("stop", "length")


def test_serve_monitor_killed_leaves_no_triton_prometheus_alertmanager(model_repo: Path, root: Path,
                                                                       env: dict[str, str]) -> None:
    from llmpipe.processes import free_ports
    from llmpipe.serving.monitoring import alertmanager_binary, prometheus_binary

    if prometheus_binary() is None or alertmanager_binary() is None:
        pytest.skip("prometheus / alertmanager not installed (scripts/install.sh --test)")
    ports = [str(p) for p in free_ports(6)]
    cmd = Command([*CLI, "serve", str(model_repo), "--monitor", "--http-port", ports[0], "--grpc-port", ports[1],
                   "--metrics-port", ports[2], "--prometheus-port", ports[3], "--alertmanager-port", ports[4],
                   "--api-port", ports[5]],
                  root / "serve-monitor.log", env)

    def all_up(procs: list[psutil.Process]) -> bool:
        names = [_cmdline(p) for p in procs]
        return triton_up(procs) and any("prometheus --config" in c or "/prometheus " in c for c in names) \
            and any("alertmanager" in c for c in names)

    _check(cmd, all_up, "tritonserver, prometheus and alertmanager", signal.SIGKILL)


def test_serve_on_a_taken_port_says_which_and_leaves_no_triton(model_repo: Path, env: dict[str, str]) -> None:
    """Triton starts without its metrics service when only that port is taken: ``llmpipe serve``
    must refuse in one line naming the port, and stop the server it started."""
    import socket

    from llmpipe.processes import free_ports

    def tritons() -> set[int]:
        return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "tritonserver" and _running(p)}

    before = tritons()
    ports = [str(p) for p in free_ports(3)]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics = taken.getsockname()[1]
        done = subprocess.run([*CLI, "serve", str(model_repo), "--http-port", ports[0], "--grpc-port", ports[1],
                               "--metrics-port", str(metrics), "--api-port", ports[2]], env=env, capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("llmpipe:")]
    assert len(said) == 1 and f"its metrics port 127.0.0.1:{metrics} is in use by another process" in said[0], \
        done.stderr[-2000:]
    deadline = time.monotonic() + SURVIVOR_S
    while tritons() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not tritons() - before, "a tritonserver outlived the refused start"


# -- llmpipe worker ------------------------------------------------------------------------------------
@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT,), (signal.SIGINT, signal.SIGINT, signal.SIGTERM),
                                     (signal.SIGKILL,)], ids=lambda s: "+".join(x.name for x in s))
def test_worker_stopped_leaves_no_prefect_worker(signals: tuple[signal.Signals, ...],
                                                 prefect_server: tuple[Command, str], root: Path,
                                                 env: dict[str, str]) -> None:
    worker_env = {**env, "PREFECT_API_URL": prefect_server[1]}
    cmd = Command([*CLI, "worker", "--pool", "no-survivors", "--state-dir", str(root / "worker-state")],
                  root / f"worker-{'+'.join(s.name for s in signals)}.log", worker_env)
    _check(cmd, lambda ps: prefect_worker_up(ps) and "started!" in cmd.log.read_text(errors="replace"),
           "the prefect worker", *signals)


def test_server_killed_leaves_no_prefect_server(prefect_server: tuple[Command, str]) -> None:
    """``llmpipe server`` (SIGTERM and SIGHUP stop it like Ctrl-C) killed: its Prefect server must go too."""
    _check(prefect_server[0], lambda ps: any("server start" in _cmdline(p) for p in ps), "the Prefect server",
           signal.SIGKILL)


# -- a Dask LocalCluster -------------------------------------------------------------------------------
DASK = textwrap.dedent(
    """
    import time
    from llmpipe.executor_dask import shared_local_cluster
    shared_local_cluster(2, 1)
    print("cluster up", flush=True)
    time.sleep(600)
    """
)


def test_dask_workers_end_with_a_killed_parent(root: Path, env: dict[str, str]) -> None:
    """The LocalCluster's Nannies run in the parent; their worker processes must not outlive it."""
    cmd = Command([sys.executable, "-c", DASK], root / "dask.log", env)
    # to the parent alone: its group holds the workers, and a group kill would end them directly
    _check(cmd, lambda ps: sum("multiprocessing.spawn" in _cmdline(p) for p in ps) >= 2, "2 Dask workers",
           signal.SIGKILL, group=False)
