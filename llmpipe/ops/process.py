"""Background processes that never outlive their owner: servers, workers, schedulers.

Why this exists: a Prefect worker started in the background ignores the first SIGINT/SIGTERM (it
waits for its flow runs), and the flow runs it starts may sit in their own process sessions, so a
plain ``terminate()`` leaks processes that keep ports and SQLite files busy. :class:`ManagedProcess`
starts the command in a new session, logs to a file, and stops it in escalating steps: a signal, a
second signal after a grace period, then SIGKILL for the process group and every descendant it saw.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import psutil

_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_http(url: str, timeout: float = 60.0, proc: ManagedProcess | None = None) -> None:
    """Poll ``url`` until it answers HTTP 2xx; fail early with the log tail if ``proc`` dies."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.returncode()} before {url} answered:\n"
                               f"{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - local health probe
                if 200 <= r.status < 300:
                    return
                last = f"HTTP {r.status}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.25)
    tail = f"\n{proc.tail()}" if proc is not None else ""
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s (last: {last}){tail}")


class ManagedProcess:
    """A command running in its own session with its output in ``log_path``.

    Use as a context manager, or call :meth:`stop`; an ``atexit`` hook stops whatever is still
    running when the interpreter exits, so a failing test cannot leak a server.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        log_path: str | Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        name: str | None = None,
    ) -> None:
        self.cmd = [str(c) for c in cmd]
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = str(cwd) if cwd is not None else None
        self.name = name or Path(self.cmd[0]).name
        self._popen: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> ManagedProcess:
        if self._popen is not None:
            raise RuntimeError(f"{self.name} already started (pid {self._popen.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(  # noqa: S603 - commands are built by our code
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )
        _LIVE.add(self)
        return self

    def __enter__(self) -> ManagedProcess:
        return self.start() if self._popen is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        if self._popen is None:
            raise RuntimeError(f"{self.name} not started")
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def returncode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        if self._popen is None:
            raise RuntimeError(f"{self.name} not started")
        return self._popen.wait(timeout)

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the log (for error messages)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _remember_descendants(self) -> None:
        """Record children now: once the leader dies they are re-parented and can't be found."""
        if not self.alive():
            return
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                self._seen[child.pid] = child

    def stop(self, grace: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Stop the process: ``sig``, again after ``grace / 2`` s, then SIGKILL everything left.

        Idempotent. Returns the leader's exit code (None if it never started).
        """
        if self._popen is None:
            return None
        _LIVE.discard(self)
        self._remember_descendants()
        for attempt in range(2):
            if not self.alive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=grace / 2 if attempt == 0 else grace / 4)
            self._remember_descendants()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # pgid == pid: start_new_session
        for proc in self._seen.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=5)
        psutil.wait_procs([p for p in self._seen.values() if _running(p)], timeout=5)
        return self._popen.poll()

    def leftovers(self) -> list[int]:
        """PIDs of the leader and the descendants seen so far that are still running."""
        procs = list(self._seen.values())
        if self._popen is not None:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(self._popen.pid))
        return [p.pid for p in procs if _running(p)]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(Exception):
            proc.stop(grace=4.0)


@contextlib.contextmanager
def redis_server(data_dir: str | Path, timeout: float = 30.0) -> Iterator[tuple[int, ManagedProcess]]:
    """A private ``redis-server`` without persistence on a free loopback port: ``(port, process)``.

    For the Redis-backed dedup index in tests and benchmarks; stopped when the block ends. Raises
    FileNotFoundError when ``redis-server`` is not installed (``scripts/install.sh`` adds it).
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (scripts/install.sh adds it)")
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(data_dir)]
    with ManagedProcess(cmd, Path(data_dir) / "redis-server.log", name="redis-server") as proc:
        deadline = time.monotonic() + timeout
        while not _redis_pong(port):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not answer PING:\n{proc.tail()}")
            time.sleep(0.05)
        yield port, proc


def _redis_pong(port: int) -> bool:
    """Whether a Redis server on ``port`` answers ``PING`` (plain RESP over a socket, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
