"""The warm runner: ``llmpipe run`` without paying Python's and Prefect's start-up on every run.

A no-change rerun of the tiny DAG is about 3.5 s, and about 2.5 s of it is the interpreter importing
Prefect, pydantic and the flows before the first stage is looked at. ``llmpipe server`` therefore
starts, beside the Prefect server, one process that has done those imports once (``serve``). Each
``llmpipe run`` (``run_in_warm_runner``) connects to it over a Unix socket and hands over its
argv, working directory, environment and its stdin/stdout/stderr file descriptors; the warm runner
forks, and the child runs ``llmpipe run`` exactly as the command would have, writing straight to
the user's terminal or pipes. The client forwards Ctrl-C and other signals to the run's process
group and exits with the run's exit code; if the client dies, the run is stopped (SIGTERM, then
SIGKILL), as it would have died with it.

The warm runner is used only when it would run the same thing: the same Python and import path,
the same interpreter flags and ``PYTHON*`` variables, the same Prefect settings once the client's
environment and directory are applied, and none of its imported modules changed on disk since it
started. Otherwise the client is told why, runs the command itself, and the warm runner restarts
if its code went stale. ``--no-warm`` or ``LLMPIPE_WARM=0`` skip it. POSIX only.

Nothing here imports Prefect at module level: the client side runs in the ``llmpipe`` command
before it decides whether to import Prefect at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("llmpipe.warm")

INFO_FILE = "warm.json"  # in PREFECT_HOME: where the socket is, and the runner's pid
EXIT_FALLBACK = 75  # the child's exit code after it told the client to run the command itself
FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
KILL_GRACE_S = 10.0  # after a client vanishes: SIGTERM, then SIGKILL this much later
_HEADER = struct.Struct("!I")


# -- where it lives ---------------------------------------------------------------------------------
def prefect_home() -> Path:
    """The Prefect home this process uses (``PREFECT_HOME``, else Prefect's default)."""
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser().resolve()


def socket_path(home: Path) -> Path:
    """A short path (Unix sockets allow ~100 bytes) in a directory only this user can enter."""
    folder = Path(tempfile.gettempdir()) / f"llmpipe-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid() or folder.stat().st_mode & 0o077:
        raise PermissionError(f"{folder}: must belong to uid {os.getuid()} with mode 0700")
    return folder / f"warm-{hashlib.sha256(str(home).encode()).hexdigest()[:16]}.sock"


def supported() -> bool:
    return os.name == "posix" and hasattr(socket, "send_fds") and hasattr(socket, "SO_PEERCRED")


def enabled() -> bool:
    return supported() and os.environ.get("LLMPIPE_WARM", "1").lower() not in ("0", "false", "no", "off")


# -- messages: a length-prefixed JSON object (file descriptors ride with the header) ----------------
def _send_request(sock: socket.socket, obj: dict[str, Any], fds: list[int]) -> None:
    body = json.dumps(obj).encode()
    socket.send_fds(sock, [_HEADER.pack(len(body))], fds)
    sock.sendall(body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed mid-message")
        buf += chunk
    return bytes(buf)


def _recv_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 3)
    if len(head) < _HEADER.size:
        head += _recv_exactly(sock, _HEADER.size - len(head))
    (n,) = _HEADER.unpack(head)
    return json.loads(_recv_exactly(sock, n)), list(fds)


def _identity() -> dict[str, Any]:
    """What must match between client and warm runner, beyond the Prefect settings."""
    return {"executable": sys.executable, "path": sys.path[1:], "flags": list(sys.flags),
            "python_env": {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}}


# -- client -----------------------------------------------------------------------------------------
def run_in_warm_runner(argv: list[str]) -> int | None:
    """Run ``llmpipe <argv>`` in the warm runner: its exit code, or None to run it here instead."""
    if not enabled():
        return None
    info = prefect_home() / INFO_FILE
    try:
        path = json.loads(info.read_text())["socket"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no `llmpipe server` with a warm runner for this Prefect home
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        with _std_fds() as fds:
            _send_request(sock, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), **_identity()}, fds)
        reader = sock.makefile("rb")
        first = reader.readline().decode().strip()
    except OSError as e:
        sock.close()
        log.info("warm runner not used (%s): running here", e)
        return None
    if not first.startswith("started "):
        sock.close()
        log.info("warm runner not used (%s): running here", first.removeprefix("fallback ") or "no answer")
        return None
    log.info("running in the warm runner of `llmpipe server` (pid %s)", first.split()[1])
    return _wait_for_exit(sock, reader)


@contextlib.contextmanager
def _std_fds() -> Any:
    """The fds 0, 1, 2 to hand over (``/dev/null`` for one that is closed)."""
    opened = []
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            opened.append(null)
            fds.append(null)
    try:
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


def _wait_for_exit(sock: socket.socket, reader: Any) -> int:
    """Forward signals to the run until the warm runner reports its exit code."""
    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(f"signal {signum}\n".encode())

    previous = {}
    for name in FORWARDED_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            previous[sig] = signal.signal(sig, forward)
    try:
        while True:
            line = reader.readline().decode().strip()  # a forwarded signal does not interrupt it (PEP 475)
            if line.startswith("exit "):
                return int(line.split()[1])
            if not line:
                print("llmpipe: the warm runner went away before the run finished", file=sys.stderr)
                return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()


# -- server -----------------------------------------------------------------------------------------
def _signature(path: str) -> tuple[int, int] | None:
    """(mtime_ns, size) of a file, None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _module_files() -> dict[str, tuple[int, int]]:
    """The signature of every imported module's file: a change means this process runs stale code."""
    files = {f for mod in list(sys.modules.values()) if (f := getattr(mod, "__file__", None))}
    return {f: sig for f in files if (sig := _signature(f)) is not None}


def stale_module(snapshot: dict[str, tuple[int, int]]) -> str | None:
    """The first imported file that changed (or went) since ``snapshot``, or None."""
    return next((f for f, sig in snapshot.items() if _signature(f) != sig), None)


def _mismatch(request: dict[str, Any], snapshot: dict[str, tuple[int, int]]) -> tuple[str | None, bool]:
    """(why this runner cannot run the request, whether it is stale), or (None, False)."""
    mine = _identity()
    for key, what in (("executable", "another Python"), ("path", "another import path"),
                      ("flags", "other interpreter flags"), ("python_env", "other PYTHON* variables")):
        if request.get(key) != mine[key]:
            return what, False
    changed = stale_module(snapshot)
    if changed:
        return f"{changed} changed since the warm runner started; it restarts", True
    return None, False


def preload() -> None:
    """The imports every run pays for, done once: the CLI, Prefect, the four flows and their tasks."""
    import importlib

    from flows import cli
    from llmpipe.pipeline import load_stages
    from llmpipe.stage import gc_paused

    cli.prepare_process()
    with gc_paused():
        for name in cli.FLOW_NAMES:
            cli.flow_function(name)
        # what a run imports after it starts (sys.modules before and after a no-change rerun)
        for module in ("prefect.flow_engine", "prefect.task_engine", "prefect.utilities.visualization",
                       "anyio._backends._asyncio", "psutil"):
            importlib.import_module(module)
        load_stages()


def serve(home: Path, ready: Path | None = None) -> int:
    """Accept runs on this Prefect home's socket until SIGTERM or SIGINT."""
    import gc

    preload()
    gc.freeze()  # the preloaded objects stay: children neither scan nor copy them
    snapshot = _module_files()
    path = socket_path(home)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    info = home / INFO_FILE
    tmp = info.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"socket": str(path), "pid": os.getpid(), "started": time.time()}))
    tmp.replace(info)
    if ready is not None:
        ready.write_text(str(os.getpid()))
    print(f"warm runner: pid {os.getpid()}, socket {path}", flush=True)

    def stop(_signum: int, _frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    restart = False
    try:
        while not restart:
            conn, _ = listener.accept()
            restart = _handle(conn, listener, snapshot)
    finally:
        listener.close()
        with contextlib.suppress(OSError, ValueError):
            if json.loads(info.read_text()).get("pid") == os.getpid():
                info.unlink()
                path.unlink(missing_ok=True)
    print("warm runner: code changed on disk, restarting", flush=True)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    return 0  # pragma: no cover - execv does not return


_OPEN_CONNS: set[socket.socket] = set()  # connections of runs in progress (closed in each new child)
_CONNS_LOCK = threading.Lock()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _handle(conn: socket.socket, listener: socket.socket, snapshot: dict[str, tuple[int, int]]) -> bool:
    """Serve one connection; True when this runner must restart (its code changed)."""
    fds: list[int] = []
    try:
        if _peer_uid(conn) != os.getuid():
            conn.close()
            return False
        conn.settimeout(30)
        request, fds = _recv_request(conn)
        conn.settimeout(None)
        why, stale = _mismatch(request, snapshot)
        if why is None and len(fds) != 3:
            why = f"expected 3 file descriptors, got {len(fds)}"
        if why is not None:
            conn.sendall(f"fallback {why}\n".encode())
            conn.close()
            return stale
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's coverage is the run it does
            _child(conn, listener, request, fds)
        with _CONNS_LOCK:
            _OPEN_CONNS.add(conn)
        threading.Thread(target=_supervise, args=(conn, pid), name=f"warm-run-{pid}", daemon=True).start()
    except (OSError, ValueError, ConnectionError) as e:
        print(f"warm runner: dropped a request: {e}", flush=True)
        with contextlib.suppress(OSError):
            conn.close()
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    return False


def _supervise(conn: socket.socket, pid: int) -> None:
    """Forward the client's signals to the run; stop the run if the client goes; report its exit code."""
    lock = threading.Lock()
    alive = [True]

    def signal_run(sig: int) -> None:
        with lock:
            if alive[0]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, sig)

    def listen() -> None:
        reader = conn.makefile("rb")
        try:
            for raw in reader:
                parts = raw.decode(errors="replace").split()
                if len(parts) == 2 and parts[0] == "signal" and parts[1].isdigit():
                    signal_run(int(parts[1]))
        except (OSError, ValueError):
            pass
        with lock:
            gone = alive[0]
        if gone:  # the client went away while the run goes on: it would have died with the client
            signal_run(signal.SIGTERM)
            threading.Timer(KILL_GRACE_S, signal_run, args=(signal.SIGKILL,)).start()

    threading.Thread(target=listen, name=f"warm-signals-{pid}", daemon=True).start()
    _, status = os.waitpid(pid, 0)
    with lock:
        alive[0] = False
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: report it the way a shell does
        code = 128 - code
    if code != EXIT_FALLBACK:
        with contextlib.suppress(OSError):
            conn.sendall(f"exit {code}\n".encode())
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    with _CONNS_LOCK:
        _OPEN_CONNS.discard(conn)
    conn.close()


def _child(conn: socket.socket, listener: socket.socket, request: dict[str, Any],
           fds: list[int]) -> None:  # pragma: no cover - runs in the forked child
    """Become the client's ``llmpipe run``: its fds, directory, environment; then run and exit."""
    code = 1
    try:
        listener.close()
        for other in list(_OPEN_CONNS):  # other runs' clients must see EOF when their run ends, not ours
            other.close()
        os.setpgid(0, 0)  # the client's signals go to the run and everything it starts
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        _reopen_stdout()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["llmpipe", *request["argv"]]
        differs = _settings_differ()
        if differs:
            conn.sendall(f"fallback Prefect settings differ here: {differs}\n".encode())
            os._exit(EXIT_FALLBACK)
        conn.sendall(f"started {os.getpid()}\n".encode())
        conn.close()
        from flows import cli

        code = cli.main(request["argv"], warm=False)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - report it as the command would, then exit
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _exit_like_the_interpreter(code)


def _reopen_stdout() -> None:  # pragma: no cover - runs in the forked child
    """A new ``sys.stdout`` on fd 1: line-buffered on a terminal, as Python sets it up at start."""
    import io

    old = sys.stdout
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=getattr(old, "encoding", None),
                                  errors=getattr(old, "errors", None), line_buffering=os.isatty(1))


def _settings_differ() -> str | None:  # pragma: no cover - runs in the forked child
    """Prefect settings built from this environment and directory vs the ones loaded at preload."""
    from prefect.context import get_settings_context
    from prefect.settings import Settings

    loaded = get_settings_context().settings.model_dump()
    here = Settings().model_dump()
    keys = sorted(k for k in set(loaded) | set(here) if loaded.get(k) != here.get(k))
    return ", ".join(keys) or None


def _wait_for_prefect_queues(timeout: float) -> None:  # pragma: no cover - runs in the forked child
    """Let Prefect's log and event workers send what is queued before their exit-time drain.

    A warm run ends a second or two sooner than a fresh process would, sometimes with events still
    queued; the drain at exit then sends them all the same, but logs a "Still processing items"
    warning. Best effort: private Prefect state, read defensively.
    """
    try:
        from prefect._internal.concurrency.services import _active_services
    except ImportError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not any(getattr(s, "_queue", None) is not None and s._queue.qsize() for s in list(_active_services)):
                return
        except Exception:  # noqa: BLE001 - a nicety must never fail the run
            return
        time.sleep(0.02)


def _exit_like_the_interpreter(code: int) -> None:  # pragma: no cover - runs in the forked child
    """Join threads and run exit handlers (Prefect flushes logs and events there), then leave."""
    try:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        _wait_for_prefect_queues(timeout=2.0)
        with contextlib.suppress(Exception):
            threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize does first
        import atexit

        atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os._exit(code & 0xFF if code >= 0 else 1)


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.warm [--state-dir DIR] [--ready FILE]``, as ``llmpipe server`` starts it."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flows.warm", description=__doc__.split("\n")[0])
    ap.add_argument("--state-dir", default=".llmpipe", help="the project's state dir, as `llmpipe server` got it")
    ap.add_argument("--ready", type=Path, help="write this process's pid here once it listens")
    args = ap.parse_args(argv)
    from flows.cli import use_project_prefect

    use_project_prefect(args.state_dir)  # the same PREFECT_* environment an `llmpipe run` sets up
    return serve(prefect_home(), args.ready)


if __name__ == "__main__":
    sys.exit(main())
