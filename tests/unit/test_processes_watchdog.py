"""The watchdog of ``llmpipe.processes``: what a process started ends with it, however it ends.

Each test runs a small parent script in its own process group, lets it start children, ends it
(SIGKILL, a normal exit, signals), and checks by pid that nothing it started is left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX processes")

PRELUDE = """
import os, signal, subprocess, sys, time
from llmpipe import processes as process
process.GUARD_GRACE_S = 1.0  # the watchdog's SIGTERM -> SIGKILL delay, short for the test
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
# ignores SIGTERM (its child inherits that), and leaves a grandchild in a session of its own
STUBBORN = [sys.executable, "-c", "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
            "print(c.pid, flush=True); time.sleep(600)"]
def say(*pids):
    print(*pids, flush=True)
"""


def _start(body: str, tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as e:
        p = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], stdout=subprocess.PIPE,
                             stderr=e, text=True, start_new_session=True)
    return p, err


def _pids(p: subprocess.Popen[str]) -> list[int]:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip(), f"the parent printed nothing (exit {p.poll()})"
    return [int(x) for x in line.split()]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after ``seconds`` (they are SIGKILLed then, so no test leaks them)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_sigkilled_parent_leaves_nothing(tmp_path: Path) -> None:
    """Children of spawn (one ignores SIGTERM, its grandchild sits in its own session) and a plain
    Popen child, noted by a scan, all end after the parent is SIGKILLed."""
    p, err = _start("""
        a = process.spawn(SLEEP)
        b = process.spawn(STUBBORN, stdout=subprocess.PIPE, text=True)
        grandchild = int(b.stdout.readline())
        c = subprocess.Popen(SLEEP)
        process.guard()  # note c now, not at the next scan
        say(a.pid, b.pid, grandchild, c.pid, process._Guardian.popen.pid)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
        """, tmp_path)
    *children, guardian = _pids(p)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert _gone_within(children, 10) == [], err.read_text()
    assert _gone_within([guardian], 5) == []
    text = err.read_text()
    assert f"pid {p.pid} ended; stopping what it left running" in text
    assert "SIGKILL for what still runs" in text  # the stubborn one and its grandchild needed it


def test_a_child_left_at_normal_exit_is_ended_and_the_watchdog_leaves(tmp_path: Path) -> None:
    p, _ = _start("""
        a = process.spawn(SLEEP)
        say(a.pid, process._Guardian.popen.pid)
        """, tmp_path)
    child, guardian = _pids(p)
    assert p.wait(timeout=30) == 0
    assert _gone_within([child, guardian], 10) == []


def test_a_parent_that_stops_its_children_leaves_no_watchdog_behind(tmp_path: Path) -> None:
    p, err = _start("""
        with process.ManagedProcess(SLEEP, os.devnull) as m:
            say(m.pid, process._Guardian.popen.pid)
        """, tmp_path)
    child, guardian = _pids(p)
    assert p.wait(timeout=30) == 0
    assert _gone_within([child, guardian], 3) == []
    assert "watchdog" not in err.read_text()  # it had nothing to stop


def test_a_forked_child_has_its_own_watchdog(tmp_path: Path) -> None:
    """A forked child does not hold its parent's pipe: its own children end when it is killed,
    while the parent lives on."""
    p, _ = _start("""
        process.guard()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            a = process.spawn(SLEEP)
            os.write(w, f"{a.pid}\\n".encode())
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        os.close(w)
        grandchild = int(os.read(r, 100))
        os.waitpid(pid, 0)
        say(grandchild, os.getpid())
        time.sleep(600)
        """, tmp_path)
    grandchild, parent = _pids(p)
    try:
        assert _gone_within([grandchild], 10) == []
        assert p.poll() is None and _alive(parent)
    finally:
        p.kill()
        p.wait(timeout=10)


def test_run_foreground_passes_two_signals_on_and_kills_at_the_third(tmp_path: Path) -> None:
    p, _ = _start("""
        import threading
        child = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, lambda *a: print('got', flush=True)); "
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
        def report():
            time.sleep(1.0)
            say(*(c.pid for c in psutil.Process().children() if c.pid != process._Guardian.popen.pid))
        import psutil
        threading.Thread(target=report, daemon=True).start()
        code = process.run_foreground(child, grace=60)
        print("exit", code, flush=True)
        """, tmp_path)
    (child,) = _pids(p)
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        assert p.poll() is None
        os.kill(p.pid, sig)
        time.sleep(0.3)
    out, _ = p.communicate(timeout=30)
    assert "exit 130" in out
    assert _gone_within([child], 5) == []


def test_local_executor_pool_workers_end_with_a_killed_parent(tmp_path: Path) -> None:
    """Forked pool workers of a parent killed mid-map would wait for work forever."""
    p, _ = _start("""
        import threading
        import psutil
        from llmpipe.executor import LocalExecutor
        def slow(x):
            time.sleep(60)
        threading.Thread(target=LocalExecutor(2).map, args=(slow, [1, 2, 3]), daemon=True).start()
        me = psutil.Process()
        while len(kids := [c for c in me.children() if c.cmdline() == me.cmdline()]) < 2:
            time.sleep(0.05)
        time.sleep(process.GUARD_SCAN_S + 0.5)  # the watchdog's next scan notes them
        say(*(c.pid for c in kids))
        os.kill(os.getpid(), signal.SIGKILL)
        """, tmp_path)
    workers = _pids(p)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert _gone_within(workers, 10) == []
