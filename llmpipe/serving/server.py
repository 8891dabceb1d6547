"""A real local Triton server for a generated model repository.

The binary comes from the ``nvidia-pytriton`` wheel (Triton 2.51 + Python backend, runs on CPU),
installed with ``pip install --no-deps nvidia-pytriton`` because the wheel pins numpy < 2 (see
scripts/install.sh). What it takes to run it from our venv, found by trying:

* ``LD_LIBRARY_PATH``: the wheel's bundled libraries (``nvidia_pytriton.libs``) and the
  interpreter's ``LIBDIR`` (the Python-backend stub links ``libpython3.X.so``).
* The stub for this Python version (the wheel ships one per version) must sit next to
  ``libtriton_python.so``; we build a small runtime dir of symlinks plus that stub.
* The stub embeds the base interpreter, whose ``sys.path`` lacks the venv: ``PYTHONPATH`` gets the
  venv's site-packages (so model.py sees our torch / transformers) and ``PATH`` the venv's bin.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

from llmpipe.processes import free_ports, interrupt_on, spawn, stop_tree
from llmpipe.serving.config import STREAM_SUFFIX
from llmpipe.serving.layout import DEPLOY
from llmpipe.serving.repository import REPO_DIR, serving_copy
from llmpipe.serving.triton_model import CHECKPOINT_DIR


class ServerError(RuntimeError):
    """The server could not start, or died; the message carries the tail of its log."""


@dataclass
class TritonServer:
    """A running server: where to reach it and where its log is."""

    http_port: int
    grpc_port: int
    metrics_port: int
    process: subprocess.Popen
    log_path: Path
    repo: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Triton's Prometheus metrics (``monitoring.read_metrics`` reads them)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def triton_dist() -> Path:
    """The Triton distribution inside the nvidia-pytriton wheel."""
    spec = importlib.util.find_spec("pytriton")  # locate only: importing it needs its unused deps
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("Triton server binary not found: run scripts/install.sh "
                          "(pip install --no-deps nvidia-pytriton)")
    dist = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise ServerError(f"{dist}: no bin/tritonserver in the nvidia-pytriton install")
    return dist


def available() -> bool:
    """Whether a local Triton server can be started here (tests skip with a reason when not)."""
    try:
        triton_dist()
    except ServerError:
        return False
    return True


def prepare_runtime(dest: Path | None = None) -> Path:
    """A Triton tree (symlinks) with the Python-backend stub for this interpreter; returns its root."""
    dist = triton_dist()
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = dist / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton has no Python-backend stub for Python {ver}")
    root = dest or Path(tempfile.gettempdir()) / f"llmpipe-triton-{os.getuid()}-py{ver}"
    py = root / "backends" / "python"
    py.mkdir(parents=True, exist_ok=True)
    (root / "bin").mkdir(exist_ok=True)
    links = {root / "bin" / "tritonserver": dist / "bin" / "tritonserver",
             py / "libtriton_python.so": dist / "backends" / "python" / "libtriton_python.so",
             py / "triton_python_backend_utils.py": dist / "backends" / "python" / "triton_python_backend_utils.py",
             root / "caches": dist / "caches"}
    for link, target in links.items():
        if not (link.is_symlink() and link.resolve() == target.resolve()):
            tmp_link = link.with_name(f".{link.name}-{os.getpid()}")
            tmp_link.unlink(missing_ok=True)
            tmp_link.symlink_to(target)
            tmp_link.replace(link)  # atomic: concurrent test processes never see a half-made tree
    if not (py / "triton_python_backend_stub").is_file():
        tmp = py / f".stub-{os.getpid()}"
        shutil.copy2(stub, tmp)
        tmp.replace(py / "triton_python_backend_stub")
    return root


def server_env() -> dict[str, str]:
    """Environment that lets the bundled binary and stub run with this venv's packages."""
    env = os.environ.copy()
    libs = [str(triton_dist().parent.parent / "nvidia_pytriton.libs"),
            str(sysconfig.get_config_var("LIBDIR") or "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in [*libs, env.get("LD_LIBRARY_PATH", "")] if p)
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env["PYTHONPATH"] = ":".join(dict.fromkeys([*site, *filter(None, [env.get("PYTHONPATH")])]))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    return env


def _answers(url: str) -> bool:
    """Whether ``url`` answers 200 (readiness, metrics)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def serve(repo_dir: str | Path, http_port: int = 0, grpc_port: int = 0, *, metrics_port: int = 0,
          startup_timeout_s: float = 180.0, stop_timeout_s: float = 20.0, cache_bytes: int = 64 << 20,
          log_path: Path | None = None) -> Iterator[TritonServer]:
    """Run tritonserver on 127.0.0.1 for ``repo_dir`` until the block exits.

    The server runs on a copy of the repository (:func:`repository.serving_copy`, removed on exit):
    what it writes never lands in ``repo_dir``. Port 0 picks a free port. Waits for
    ``/v2/health/ready`` and a metrics port that answers; on exit sends SIGTERM and, after
    ``stop_timeout_s``, SIGKILL. Raises ServerError (with the log tail) if it dies or never gets
    ready, and PortBusy, naming the port, when one of the given ports is taken; a port it picked
    itself and found taken (another process bound it in between) is picked again, up to
    ``PORT_ATTEMPTS`` starts.
    """
    repo = Path(repo_dir).resolve()
    if (repo / REPO_DIR).is_dir():  # a deploy artifact: its repository is one level down
        repo = repo / REPO_DIR
    configs = sorted(repo.glob("*/config.pbtxt"))
    if not configs:
        raise ServerError(f"{repo}: not a Triton model repository (no <model>/config.pbtxt)")
    runtime = prepare_runtime()
    run_repo = serving_copy(repo)  # the server writes (bytecode) into a copy, never into the artifact
    wanted = (http_port, grpc_port, metrics_port)
    cache = any("response_cache" in c.read_text() for c in configs)
    regions = f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}_"  # this server's backend shared memory
    _remove_stale_regions()
    log_path = log_path or Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
    server = None
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                server = _start(runtime, run_repo, repo, _fill_ports(wanted), cache_bytes if cache else 0,
                                regions, log_path, startup_timeout_s, stop_timeout_s)
                break
            except PortBusy as e:  # a port we picked was taken between our pick and Triton's bind: pick again
                if e.port in wanted or attempt == PORT_ATTEMPTS:
                    raise
        assert server is not None
        yield server
    finally:
        if server is not None:
            stop(server, stop_timeout_s)
        shutil.rmtree(run_repo, ignore_errors=True)
        _remove_regions(regions)  # a server stopped while it loaded its models leaves them


PORT_ATTEMPTS = 3  # starts with freshly picked ports when Triton finds one of ours taken


class PortBusy(ServerError):
    """A port Triton was given is in use by another process (``port``: which, 0 when the log does not say)."""

    def __init__(self, message: str, port: int = 0) -> None:
        super().__init__(message)
        self.port = port


def _fill_ports(wanted: tuple[int, int, int]) -> list[int]:
    """The given ports, 0s replaced by distinct free ones that are none of the given ones: k given
    ports strike at most k of the picks, which leaves one more than the 3 - k ports to fill."""
    picked = iter(p for p in free_ports(len(wanted) + 1) if p not in wanted)
    return [p or next(picked) for p in wanted]


def _start(runtime: Path, run_repo: Path, repo: Path, ports: list[int], cache_bytes: int, regions: str,
           log_path: Path, startup_timeout_s: float, stop_timeout_s: float) -> TritonServer:
    """One tritonserver on ``ports`` (HTTP, gRPC, metrics), ready and answering on all three."""
    cmd = [str(runtime / "bin" / "tritonserver"), f"--model-repository={run_repo}",
           f"--backend-directory={runtime / 'backends'}", f"--cache-directory={runtime / 'caches'}",
           "--http-address=127.0.0.1", f"--http-port={ports[0]}",
           "--grpc-address=127.0.0.1", f"--grpc-port={ports[1]}",
           "--metrics-address=127.0.0.1", f"--metrics-port={ports[2]}",
           "--exit-timeout-secs=5", "--log-verbose=0", "--strict-readiness=true",
           # request/queue latency quantiles on the metrics port (the p99 alert of deployments/monitoring)
           "--metrics-config=summary_latencies=true",
           f"--backend-config=python,shm-region-prefix-name={regions}"]
    if cache_bytes:
        cmd.append(f"--cache-config=local,size={cache_bytes}")
    with open(log_path, "wb") as log:  # spawn: own session; ends with this process however it ends
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())
    server = TritonServer(ports[0], ports[1], ports[2], proc, Path(log_path), repo)
    try:
        _wait_ready(server, startup_timeout_s)
    except BaseException:
        stop(server, stop_timeout_s)
        raise
    return server


SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "llmpipe_triton_"  # + the pid of the process that started the server + a token


def _remove_regions(prefix: str) -> None:
    """Remove the Python backend's shared-memory regions named ``prefix*`` (1 MiB each, in RAM)."""
    for f in SHM_DIR.glob(f"{prefix}*") if SHM_DIR.is_dir() else []:
        with suppress(OSError):
            f.unlink()


def _remove_stale_regions() -> None:
    """Regions of servers whose starter is gone: killed before it could remove them (its watchdog
    ended the server, and only the starter knew the regions' names)."""
    for f in SHM_DIR.glob(f"{SHM_PREFIX}*") if SHM_DIR.is_dir() else []:
        pid = f.name[len(SHM_PREFIX):].split("_", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            with suppress(OSError):
                f.unlink()


def _wait_ready(server: TritonServer, timeout_s: float) -> None:
    """Until the server is ready and its metrics port answers; PortBusy when Triton could not bind one
    of its ports. Triton exits when its HTTP or gRPC port is taken, but it starts without its metrics
    service when only that port is, and reports ready: a server whose metrics nobody could scrape."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = server.process.poll() is not None
        busy = _busy_port(server.log_tail(200))
        if busy is not None:
            service, port = busy
            raise PortBusy(f"tritonserver could not start: its {service} port 127.0.0.1:{port} is in use by "
                           f"another process (log {server.log_path})", port)
        if exited:
            raise ServerError(f"tritonserver exited with code {server.process.returncode} before it was "
                              f"ready; log {server.log_path}:\n{server.log_tail()}")
        if _answers(f"http://{server.http_url}/v2/health/ready") and _answers(server.metrics_url):
            return
        time.sleep(0.25)
    raise ServerError(f"tritonserver not ready after {timeout_s:.0f}s (HTTP {server.http_url}, metrics "
                      f"{server.metrics_url}); log {server.log_path}:\n{server.log_tail()}")


_BUSY = re.compile(r"failed to start (\w+) service: .*?:(\d+)'? already in use", re.IGNORECASE)


def _busy_port(log: str) -> tuple[str, int] | None:
    """(service, port) of a port the log says Triton found in use, e.g. ("metrics", 8002)."""
    m = _BUSY.search(log)
    return None if m is None else (m.group(1).lower().replace("grpc", "gRPC").replace("http", "HTTP"), int(m.group(2)))


def stop(server: TritonServer, timeout_s: float = 20.0) -> int:
    """SIGTERM the server's process group (its Python-backend stubs too), SIGKILL it and every
    descendant after ``timeout_s``; returns the exit code."""
    code = stop_tree(server.process, grace=timeout_s)
    return int(code if code is not None else server.process.wait(timeout=10))


def resolve_artifact(artifact: str | Path | None, config: str | Path | None = None) -> Path:
    """A deploy artifact (or model repository) directory from a path, a key / key prefix, or the latest.

    Keys and "latest" are looked up in the store of ``config`` (the lead's ``llmpipe serve`` passes
    ``--config``); a path that exists is used as is.
    """
    if artifact is not None and Path(artifact).is_dir():
        return Path(artifact)
    if config is None:
        raise FileNotFoundError(f"deploy artifact {artifact!r} is not a directory, and no config names a store")
    from llmpipe.config import load_config
    from llmpipe.dag import open_store

    store = open_store(load_config(config))
    if artifact is None:
        art = store.latest("deploy")
        if art is None:
            raise FileNotFoundError(f"no deploy artifact in the store of {config}: run the release flow first")
        return Path(art.path)
    hit = store.find(str(artifact))
    if hit is None:
        raise FileNotFoundError(f"{artifact!r}: not a directory nor a unique artifact key in the store of {config}")
    return Path(store.path(*hit))


def deployed_engine(artifact_dir: Path) -> str:
    """What serves this artifact when ``llmpipe serve`` is not told (``--engine``): the ``deploy.engine``
    its deploy stage recorded in ``deploy.json`` and checked with; ``triton`` for a bare model repository
    (or an artifact older than the key)."""
    info = artifact_dir / DEPLOY.info
    if not info.is_file():
        return "triton"
    try:
        engine = json.loads(info.read_text(encoding="utf-8")).get("engine", "triton")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{info}: not a deploy.json object ({e})") from None
    if engine not in ("triton", "vllm"):
        raise ValueError(f"{info}: engine {engine!r} is neither 'triton' nor 'vllm'")
    return engine


def main_serve(artifact_dir: str | Path | None = None, config: str | Path | None = None, http_port: int = 8000,
               grpc_port: int = 8001, metrics_port: int = 8002, startup_timeout_s: float = 180.0,
               monitor_dir: Path | None = None, prometheus_port: int = 9090, alertmanager_port: int = 9093,
               api_port: int | None = 8080, api_host: str = "127.0.0.1", api_key: str | None = None) -> int:
    """``llmpipe serve [ARTIFACT]``: serve a deploy artifact (or a model repository) until Ctrl-C.

    ``api_port`` (None: none): the OpenAI-compatible API in front of the server
    (:mod:`llmpipe.serving.openai_api`), on ``api_host`` (loopback unless told), with ``api_key``
    required when given; it runs in this process and stops with it. ``monitor_dir`` (``--monitor``: deployments/monitoring): also Prometheus scraping the server with
    its ``alerts.yml`` and Alertmanager routing with its ``alertmanager.yml`` to a local webhook that
    prints every alert here; they stop with the server.
    """
    repo = resolve_artifact(artifact_dir, config)
    try:  # SIGTERM/SIGHUP stop it like Ctrl-C: the server and its stubs are stopped, not left serving
        with interrupt_on(signal.SIGTERM, signal.SIGHUP), \
                serve(repo, http_port, grpc_port, metrics_port=metrics_port, startup_timeout_s=startup_timeout_s) as server, \
                _api(server, api_port, api_host, api_key) as api, \
                _monitoring(server, monitor_dir, prometheus_port, alertmanager_port, api):
            models = ", ".join(c.parent.name for c in sorted(server.repo.glob("*/config.pbtxt")))
            print(f"serving {models}: HTTP {server.http_url}  gRPC {server.grpc_url}  "
                  f"metrics 127.0.0.1:{server.metrics_port}  (log {server.log_path}); Ctrl-C stops", flush=True)
            if api is not None:
                print(f"OpenAI-compatible API: {api.url}  (model {api.model}{', API key required' if api_key else ''})",
                      flush=True)
            while server.process.poll() is None:
                time.sleep(0.5)
            print(f"tritonserver exited with code {server.process.returncode}:\n{server.log_tail()}",
                  file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0


def main_api(artifact_dir: str | Path | None, triton_grpc: str, config: str | Path | None = None,
             api_port: int = 8080, api_host: str = "127.0.0.1", api_key: str | None = None) -> int:
    """``llmpipe serve --triton HOST:PORT``: only the OpenAI API, in front of a Triton that runs
    elsewhere (compose's ``api-N`` beside ``triton-N``), until Ctrl-C or SIGTERM.

    The artifact (or model repository) gives the tokenizer, chat template and limits; the models run
    in that Triton. One API per replica, so Prometheus sees each replica's TTFT and inter-token latency.
    """
    from llmpipe.serving.openai_api import api_config, serve_api

    cfg = api_config(resolve_artifact(artifact_dir, config), triton_grpc, api_key=api_key)
    try:
        with interrupt_on(signal.SIGTERM, signal.SIGHUP), serve_api(cfg, api_host, api_port) as api:
            print(f"OpenAI-compatible API: {api.url}  (model {cfg.name} on Triton {triton_grpc}"
                  f"{', API key required' if api_key else ''}); Ctrl-C stops", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0


def deployed_checkpoint(artifact_dir: Path) -> tuple[str, Path]:
    """(model name, checkpoint folder) of the batch model in a deploy artifact or model repository: the
    Hugging Face folder vLLM serves as it is."""
    repo = artifact_dir / REPO_DIR if (artifact_dir / REPO_DIR).is_dir() else artifact_dir
    found = [p for p in repo.glob(f"*/*/{CHECKPOINT_DIR}/config.json")
             if not p.parents[2].name.endswith(STREAM_SUFFIX)]
    if not found:
        raise FileNotFoundError(f"{repo}: no <model>/<version>/{CHECKPOINT_DIR}/ with a config.json (a deploy "
                                f"artifact of the python backend)")
    newest = max(found, key=lambda p: int(p.parents[1].name) if p.parents[1].name.isdigit() else -1)
    return newest.parents[2].name, newest.parent


def main_serve_vllm(artifact_dir: str | Path | None = None, config: str | Path | None = None,
                    api_port: int = 8080, api_host: str = "127.0.0.1", api_key: str | None = None,
                    startup_timeout_s: float = 600.0, enforce_eager: bool = False) -> int:
    """``llmpipe serve --engine vllm``: vLLM's own OpenAI server on the deployed checkpoint until Ctrl-C
    (``enforce_eager``: vLLM's ``--enforce-eager``, a start without torch.compile).

    The same ``/v1`` API and model name as our engine's front end, served by vLLM
    (:mod:`llmpipe.serving.vllm_engine`: its CPU build in its own environment, or the GPU build).
    """
    from llmpipe.serving.vllm_engine import vllm_server

    name, checkpoint = deployed_checkpoint(resolve_artifact(artifact_dir, config))
    log_path = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    try:
        with interrupt_on(signal.SIGTERM, signal.SIGHUP), \
                vllm_server(checkpoint, log_path, host=api_host, port=api_port or None, model_name=name,
                            api_key=api_key, startup_timeout=startup_timeout_s, enforce_eager=enforce_eager) as server:
            print(f"OpenAI-compatible API (vLLM): {server.base_url}  (model {name}"
                  f"{', API key required' if api_key else ''}; log {log_path}); Ctrl-C stops", flush=True)
            while server.process.alive():
                time.sleep(0.5)
            print(f"vLLM exited with code {server.process.returncode()}:\n{server.process.tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 0


@dataclass
class _Api:
    url: str
    model: str


@contextmanager
def _api(server: TritonServer, port: int | None, host: str, api_key: str | None) -> Iterator[_Api | None]:
    """The OpenAI-compatible API in front of ``server`` (None: not started)."""
    if port is None:
        yield None
        return
    from llmpipe.serving.openai_api import api_config, serve_api

    cfg = api_config(server.repo, server.grpc_url, api_key=api_key)
    with serve_api(cfg, host, port) as api:  # ApiPortBusy, naming the port, when it is taken
        yield _Api(api.url, cfg.name)


@contextmanager
def _monitoring(server: TritonServer, monitor_dir: Path | None, prometheus_port: int,
                alertmanager_port: int, api: _Api | None = None) -> Iterator[None]:
    if monitor_dir is None:
        yield
        return
    from llmpipe.serving import monitoring

    work = Path(tempfile.mkdtemp(prefix="llmpipe-monitor-"))
    try:
        with monitoring.monitor(work, [f"127.0.0.1:{server.metrics_port}"], [Path(monitor_dir) / "alerts.yml"],
                                Path(monitor_dir) / "alertmanager.yml", prometheus_port=prometheus_port,
                                alertmanager_port=alertmanager_port,
                                api_targets=[api.url.split("://", 1)[1].removesuffix("/v1")] if api else None,
                                on_notification=lambda n: print(monitoring.describe(n), flush=True)) as mon:
            print(f"monitoring: Prometheus {mon.prometheus.url}  Alertmanager {mon.alertmanager.url}  "
                  f"(rules {Path(monitor_dir) / 'alerts.yml'}; alerts print here)", flush=True)
            yield
    finally:
        shutil.rmtree(work, ignore_errors=True)
