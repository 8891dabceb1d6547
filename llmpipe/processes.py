"""Background processes that never outlive their owner: servers, workers, schedulers, launchers.

Why this exists: a Prefect worker started in the background ignores the first SIGINT/SIGTERM (it
waits for its flow runs), and the flow runs it starts may sit in their own process sessions, so a
plain ``terminate()`` leaks processes that keep ports and SQLite files busy. :class:`ManagedProcess`
starts the command in a new session, logs to a file, and stops it in escalating steps: a signal, a
second signal after a grace period, then SIGKILL for the process group and every descendant it saw.

Children run in sessions of their own so that a terminal's Ctrl-C reaches them only through their
parent; that is also why nothing ends them when the parent is killed. :func:`guard` closes that gap:
once per process it starts a watchdog (this file run as a script) that ends every descendant of
the process when the process ends, by exit or by any signal, SIGKILL included. Every launcher of
the project goes through :func:`spawn` (or :class:`ManagedProcess`, or :func:`run_foreground`),
which starts the child guarded, and stops it with :func:`stop_tree`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

_LIVE: weakref.WeakSet[ManagedProcess] = weakref.WeakSet()
GUARD_GRACE_S = 5.0  # the watchdog's SIGTERM -> SIGKILL delay for what a dead process left running
GUARD_SCAN_S = 1.0  # how often the watchdog notes the descendants of the process it watches


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now. Their sockets stay bound until all are
    picked: ``n`` calls of :func:`free_port` can get the same port back (the OS reuses a port just
    released), and a server given it twice fails to start ("already in use")."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


def wait_for_http(url: str, timeout: float = 60.0, proc: ManagedProcess | None = None) -> None:
    """Poll ``url`` until it answers HTTP 2xx; fail early with the log tail if ``proc`` dies."""
    import urllib.error  # here, not at the top: the watchdog runs this file and needs none of it
    import urllib.request

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


# -- the watchdog: what this process starts ends with it ------------------------------------------
class _Guardian:
    """This process's watchdog: its Popen and the write end of the pipe it reads (one per process)."""

    lock = threading.Lock()
    popen: subprocess.Popen[bytes] | None = None
    fd: int | None = None
    owner: int | None = None  # the pid that started it: a forked child needs its own
    failed = False


def guard(pid: int | None = None) -> bool:
    """Tie this process's descendants to it: they end when it ends, whichever signal ended it.

    The first call starts the watchdog: ``python process.py --guardian PID`` in a session of its
    own, so neither a terminal's Ctrl-C nor a kill of this process group reaches it. It reads a
    pipe whose write end only this process holds and notes this process's descendants every
    ``GUARD_SCAN_S``. When the pipe ends and its parent pid changes (this process is gone, by exit
    or by a signal), it sends SIGTERM to every process it noted that is still running and to their
    descendants, and SIGKILL to what is left ``GUARD_GRACE_S`` later, then exits. A parent-death
    signal (``PR_SET_PDEATHSIG``) would not do: it fires when the *thread* that forked dies, reaches
    only the child and not the grandchildren (torchrun's workers, Triton's backend stubs, a Prefect
    worker's flow runs sit in sessions of their own), and is Linux-only.

    ``pid``: a child just started, watched from now on (with its process group and its descendants,
    even once they leave the group), rather than from the next scan. Returns False where no
    watchdog runs (not POSIX, or it could not start); nothing else changes then.
    """
    if os.name != "posix":
        return False
    with _Guardian.lock:
        if not _guardian_up():
            return False
        msg = "scan\n"
        if pid is not None:
            try:
                msg = f"add {pid} {psutil.Process(pid).create_time():.3f}\n"
            except psutil.Error:
                return True  # already gone: nothing to watch
        try:
            os.write(_Guardian.fd, msg.encode())  # type: ignore[arg-type]
        except OSError:  # the watchdog died: start another and tell it again
            _drop_guardian()
            if not _guardian_up():
                return False
            with contextlib.suppress(OSError):
                os.write(_Guardian.fd, msg.encode())  # type: ignore[arg-type]
        return True


def _guardian_up() -> bool:
    """Start the watchdog unless it runs (called with the lock held); False if it cannot run."""
    if _Guardian.owner != os.getpid():  # none yet, or the pipe of a parent we were forked from
        _drop_guardian()
    elif _Guardian.popen is not None and _Guardian.popen.poll() is None:
        return True
    elif _Guardian.popen is not None:  # it died (it ignores all but SIGKILL): restart it once
        if _Guardian.failed:
            return False
        _Guardian.failed = True
        print(f"llmpipe: the process watchdog exited with code {_Guardian.popen.returncode}; starting another",
              file=sys.stderr)
        _drop_guardian()
    if not sys.executable:
        return False
    read_fd, write_fd = os.pipe()  # both close-on-exec: no other child inherits the write end
    try:
        _Guardian.popen = subprocess.Popen(  # noqa: S603 - our own file, run by our interpreter
            [sys.executable, "-I", str(Path(__file__).resolve()), "--guardian", str(os.getpid()),
             str(GUARD_GRACE_S), str(GUARD_SCAN_S)],
            stdin=read_fd, stdout=subprocess.DEVNULL, cwd="/", start_new_session=True)
    except OSError as e:
        os.close(write_fd)
        print(f"llmpipe: cannot start the process watchdog ({e}); children may outlive this process",
              file=sys.stderr)
        return False
    finally:
        os.close(read_fd)
    _Guardian.fd, _Guardian.owner = write_fd, os.getpid()
    return True


def _drop_guardian() -> None:
    if _Guardian.fd is not None:
        with contextlib.suppress(OSError):
            os.close(_Guardian.fd)
    _Guardian.fd = _Guardian.popen = _Guardian.owner = None


def _forget_guardian_in_child() -> None:
    """A forked child must not hold its parent's pipe: the watchdog would miss the parent's end."""
    _Guardian.lock = threading.Lock()  # another thread may have held it at the fork
    _Guardian.failed = False
    _drop_guardian()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_guardian_in_child)


def spawn(cmd: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen`` for a child that must not outlive this process (every launcher uses it).

    The child gets a session of its own (unless ``start_new_session`` says otherwise), so a terminal's
    Ctrl-C reaches it only through us, and is watched by this process's watchdog (:func:`guard`),
    which is started first so the child is never unwatched while this process runs on.
    """
    popen_kwargs.setdefault("start_new_session", True)
    guard()
    proc: subprocess.Popen[Any] = subprocess.Popen([str(c) for c in cmd], **popen_kwargs)  # noqa: S603
    guard(proc.pid)
    return proc


def descendants(pid: int) -> dict[int, psutil.Process]:
    """The processes below ``pid`` now, by pid (empty if it is gone)."""
    with contextlib.suppress(psutil.Error):
        return {c.pid: c for c in psutil.Process(pid).children(recursive=True)}
    return {}


def stop_tree(proc: subprocess.Popen[Any], grace: float = 10.0, sig: int = signal.SIGTERM, *,
              group: bool = True, repeat: bool = False, seen: dict[int, psutil.Process] | None = None) -> int | None:
    """Stop a child started by :func:`spawn` and everything below it; returns its exit code.

    ``sig`` goes to its process group (``group``) or to it alone, and ``repeat`` sends it again after
    ``grace / 2`` (a Prefect worker stops at the second). Whatever still runs after ``grace`` gets
    SIGKILL: the group, and every descendant seen meanwhile (``seen`` collects them across calls),
    including those in sessions of their own (torchrun's workers). Idempotent.
    """
    seen = {} if seen is None else seen
    seen.update(descendants(proc.pid))
    for attempt in range(2 if repeat else 1):
        if proc.poll() is not None:
            break
        _signal(proc.pid, sig, group)
        step = grace / 2 if repeat and attempt == 0 else grace / (4 if repeat else 1)
        deadline = time.monotonic() + step
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(descendants(proc.pid))
            time.sleep(0.05)
    seen.update(descendants(proc.pid))
    # its group, even with the leader gone: a pgid is not reused while its group has a member
    _signal(proc.pid, signal.SIGKILL, True)
    for p in seen.values():
        with contextlib.suppress(psutil.Error):
            if _running(p):
                p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    psutil.wait_procs([p for p in seen.values() if _running(p)], timeout=5)
    return proc.poll()


def _signal(pid: int, sig: int, group: bool) -> None:
    """``sig`` to ``pid``'s process group (pgid == pid: :func:`spawn` starts a session) or to it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def run_foreground(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                   grace: float = 10.0) -> int:
    """Run ``cmd`` as this command's own work until it exits; its exit code (128 + signal if we stopped it).

    It runs in its own session, guarded (:func:`spawn`), so a terminal's Ctrl-C reaches it once,
    through us. SIGINT, SIGTERM and SIGHUP are passed on to it, and a second one too; a third, or
    ``grace`` seconds after the first, kills it and everything below it (also what it leaves behind
    when it exits on its own: a worker's flow runs sit in sessions of their own).
    """
    proc = spawn(cmd, env=None if env is None else dict(env), cwd=cwd, stdin=subprocess.DEVNULL)
    got: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        got.append(signum)
        if len(got) <= 2:
            _signal(proc.pid, signum, False)

    names = ("SIGINT", "SIGTERM", "SIGHUP")
    previous = {s: signal.signal(s, on_signal) for s in (getattr(signal, n) for n in names)}
    seen: dict[int, psutil.Process] = {}
    try:
        first: float | None = None
        while proc.poll() is None:
            if got and first is None:
                first = time.monotonic()
            if first is not None and (len(got) >= 3 or time.monotonic() - first > grace):
                stop_tree(proc, 0.0, signal.SIGKILL, seen=seen)
                break
            seen.update(descendants(proc.pid))
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:  # an exception of our own: never leave it behind
            stop_tree(proc, grace, seen=seen)
        else:
            stop_tree(proc, 0.0, seen=seen)  # what it left in sessions of their own
    code = proc.returncode
    return 128 + got[0] if got and (code is None or code < 0) else int(code if code is not None else 1)


@contextlib.contextmanager
def interrupt_on(*signals: int) -> Iterator[None]:
    """Inside the block these signals raise KeyboardInterrupt, as Ctrl-C does, so ``finally`` and
    ``with`` blocks stop children cleanly (Python's default for SIGTERM ends at once, skipping them).
    Main thread only; the previous handlers come back on exit."""
    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class ManagedProcess:
    """A command running in its own session with its output in ``log_path``.

    Use as a context manager, or call :meth:`stop`; an ``atexit`` hook stops whatever is still
    running when the interpreter exits, so a failing test cannot leak a server, and the watchdog
    (:func:`guard`) ends it when this process is killed.
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
            self._popen = spawn(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, cwd=self.cwd)
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

    def stop(self, grace: float = 10.0, sig: int = signal.SIGTERM) -> int | None:
        """Stop the process: ``sig``, again after ``grace / 2`` s, then SIGKILL everything left.

        Idempotent. Returns the leader's exit code (None if it never started).
        """
        if self._popen is None:
            return None
        _LIVE.discard(self)
        return stop_tree(self._popen, grace, sig, group=False, repeat=True, seen=self._seen)

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


# -- the watchdog itself: ``python process.py --guardian PARENT GRACE SCAN`` -----------------------
class _Watch:
    """What the watchdog knows: processes below the parent, and the children registered by ``add``."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.me = os.getpid()
        self.known: dict[int, psutil.Process] = {}
        self.leaders: dict[int, psutil.Process] = {}  # registered children: their process groups are ours
        try:
            self.parent_proc: psutil.Process | None = psutil.Process(parent)
        except psutil.Error:
            self.parent_proc = None

    def note(self, p: psutil.Process) -> None:
        old = self.known.get(p.pid)
        if p.pid != self.me and (old is None or not _running(old)):
            self.known[p.pid] = p

    def scan(self) -> None:
        """Note the parent's descendants now; forget the dead."""
        self.known = {pid: p for pid, p in self.known.items() if _running(p)}
        self.leaders = {pid: p for pid, p in self.leaders.items() if _running(p) or self._group_alive(pid)}
        if self.parent_proc is not None:
            with contextlib.suppress(psutil.Error):
                for c in self.parent_proc.children(recursive=True):
                    self.note(c)

    def _group_alive(self, pgid: int) -> bool:
        return any(_pgid(p) == pgid for p in self.known.values() if _running(p))

    def handle(self, line: str) -> None:
        parts = line.split()
        if parts[:1] == ["scan"]:
            self.scan()
        elif parts[:1] == ["add"] and len(parts) == 3:
            with contextlib.suppress(psutil.Error, ValueError):
                p = psutil.Process(int(parts[1]))
                if abs(p.create_time() - float(parts[2])) < 0.05:  # the same process, not a reused pid
                    self.leaders[p.pid] = p
                    self.note(p)

    def leftovers(self) -> dict[int, psutil.Process]:
        """Everything of ours still running: noted processes, our children's groups, all below them."""
        table = {p.pid: p for p in psutil.process_iter(["ppid"])}  # one pass over /proc
        found = {pid: p for pid, p in self.known.items() if _running(p)}
        groups = {pid for pid, p in self.leaders.items() if _running(p)}
        groups |= {g for p in found.values() if (g := _pgid(p)) in self.leaders}
        for pid, p in table.items():
            if pid not in found and groups and _pgid(p) in groups and _running(p):
                found[pid] = p
        below: dict[int, list[psutil.Process]] = {}
        for p in table.values():
            below.setdefault(p.info["ppid"], []).append(p)
        stack = list(found)
        while stack:
            for child in below.get(stack.pop(), []):
                if child.pid not in found and _running(child):
                    found[child.pid] = child
                    stack.append(child.pid)
        found.pop(self.me, None)
        found.pop(self.parent, None)
        for p in found.values():
            self.note(p)
        return found


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"llmpipe watchdog: {text}\n".encode())


def _describe(procs: dict[int, psutil.Process]) -> str:
    names = []
    for pid, p in sorted(procs.items()):
        try:
            names.append(f"{pid} {p.name()}")
        except psutil.Error:
            names.append(str(pid))
    return ", ".join(names)


def _end(watch: _Watch, grace: float) -> None:
    """SIGTERM what the dead parent left running, SIGKILL what remains ``grace`` s later."""
    left = watch.leftovers()
    if not left:
        return
    _say(f"pid {watch.parent} ended; stopping what it left running: {_describe(left)}")
    _signal_each(left, psutil.Process.terminate)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(0.1)
        left = watch.leftovers()
        if not left:
            return
    for _ in range(5):
        left = watch.leftovers()
        if not left:
            return
        _say(f"SIGKILL for what still runs {grace:.0f} s after SIGTERM: {_describe(left)}")
        _signal_each(left, psutil.Process.kill)
        psutil.wait_procs(list(left.values()), timeout=2)


def _signal_each(procs: dict[int, psutil.Process], send: Callable[[psutil.Process], None]) -> None:
    """``send`` (terminate or kill) to each process; one that is already gone is skipped."""
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            send(p)


def _guardian_main(argv: list[str]) -> int:
    """Watch ``argv[0]`` (our parent) through stdin until it is gone, then end what it left."""
    import select

    parent, grace, every = int(argv[0]), float(argv[1]), float(argv[2])
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # only SIGKILL stops the watchdog before its work is done
    watch = _Watch(parent)
    buf = b""
    pipe_end: float | None = None  # when the pipe ended (the parent's exit closes it just before re-parenting)
    next_scan = 0.0

    def read(timeout: float) -> None:
        nonlocal buf, pipe_end
        while pipe_end is None and select.select([0], [], [], timeout)[0]:
            data = os.read(0, 65536)
            if not data:
                pipe_end = time.monotonic()
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                watch.handle(line.decode(errors="replace"))
            timeout = 0.0

    while os.getppid() == parent:
        if pipe_end is None:
            read(every)
        else:  # a parent that closed its end and lives on: look less and less often
            time.sleep(0.02 if time.monotonic() - pipe_end < 2 else every)
        if time.monotonic() >= next_scan:
            watch.scan()
            next_scan = time.monotonic() + every
    read(0.0)  # what it wrote just before it went
    _end(watch, grace)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--guardian"]:
    sys.exit(_guardian_main(sys.argv[2:]))
