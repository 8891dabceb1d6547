"""ManagedProcess: a process that ignores the first SIGTERM and leaves a grandchild in its own session
(like a Prefect worker and its flow runs) is still fully stopped."""

from __future__ import annotations

import socket
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from llmpipe.processes import ManagedProcess, free_port, free_ports, wait_for_http

STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    hits = []
    def on_term(signum, frame):
        hits.append(signum)
        print("got signal", len(hits), flush=True)
        if len(hits) >= 2:
            sys.exit(3)
    signal.signal(signal.SIGTERM, on_term)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print("child", child.pid, flush=True)
    while True:
        time.sleep(0.1)
    """
)


def _child_pid(log: Path) -> int:
    for _ in range(100):
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("child "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(f"no child line in {log}")


def test_stop_escalates_and_kills_detached_children(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    proc = ManagedProcess([sys.executable, "-c", STUBBORN], log, name="stubborn").start()
    child = _child_pid(log)
    assert psutil.pid_exists(child)
    t0 = time.monotonic()
    code = proc.stop(grace=2.0)
    assert time.monotonic() - t0 < 10
    assert code == 3, proc.tail()  # exited on the second signal
    assert "got signal 2" in proc.tail()
    assert proc.leftovers() == []
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert proc.stop() == 3  # idempotent


def test_wait_for_http_reports_dead_process(tmp_path: Path) -> None:
    proc = ManagedProcess([sys.executable, "-c", "print('boom'); raise SystemExit(7)"], tmp_path / "x.log")
    with proc, pytest.raises(RuntimeError, match="exited with 7"):
        wait_for_http(f"http://127.0.0.1:{free_port()}/", timeout=10, proc=proc)
    assert "boom" in proc.tail()


def test_wait_for_http_answers(tmp_path: Path) -> None:
    port = free_port()
    server = ManagedProcess([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(tmp_path)], tmp_path / "http.log")
    with server:
        wait_for_http(f"http://127.0.0.1:{port}/", timeout=20, proc=server)
    assert not server.alive()


def test_free_ports_are_distinct_and_bindable() -> None:
    """Ports picked one call at a time can repeat (a server given one twice fails "already in use");
    free_ports keeps them apart, and each is free to bind once it returns."""
    for _ in range(50):
        ports = free_ports(5)
        assert len(set(ports)) == 5, ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
