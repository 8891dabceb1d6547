"""What ``llmpipe run`` shows in the terminal: one line per stage, the stage table, one error.

Everything else a run produces (Prefect's and our own logs, third-party warnings and progress bars,
transformers, llmcompressor and DeepSpeed chatter, the output of child processes, Prefect's
temporary-server shutdown) goes to log files under ``<state_dir>/logs/<run>/``: ``run.log`` for the
run as a whole and ``<stage>.log`` while a stage works. The terminal's streams are duplicated first,
then file descriptors 1 and 2 are pointed at the log file, so output that bypasses Python's
``sys.stdout`` (C extensions, child processes, ``atexit`` handlers) lands in the log too.

A :class:`RunConsole` is process-wide (file descriptors are): :func:`active` gives the one that is
open, and :func:`stage_output` is what a stage wrapper calls; without an open console (a Prefect
worker, a notebook, tests) both do nothing, so output goes wherever the process sends it.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

RUN_LOG = "run.log"
LATEST = "latest"
_ACTIVE: RunConsole | None = None


class RunConsole:
    """The terminal of one run, and the log files that take everything else.

    ``verbose``: leave the terminal as it is (everything shows there) but still name the log folder.
    """

    def __init__(self, log_dir: Path, verbose: bool = False) -> None:
        self.log_dir = log_dir
        self.verbose = verbose
        self.current_stage: str | None = None
        self.out: IO[str] = sys.stdout
        self.err: IO[str] = sys.stderr
        self._tty = False
        self._pending = ""
        self._head = ""

    @classmethod
    def for_run(cls, state_dir: Path, flow: str, verbose: bool = False) -> RunConsole:
        """A fresh ``<state_dir>/logs/<time>-<flow>-<pid>/`` folder, with ``logs/latest`` pointing at it."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_dir = state_dir / "logs" / f"{stamp}-{flow}-{os.getpid()}"
        log_dir.mkdir(parents=True, exist_ok=True)
        latest = log_dir.parent / LATEST
        tmp = log_dir.parent / f".{LATEST}-{os.getpid()}"
        try:
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(log_dir.name)
            os.replace(tmp, latest)
        except OSError:
            pass  # a filesystem without symlinks: the folder name still says which run it is
        return cls(log_dir, verbose)

    def open(self) -> RunConsole:
        """Keep the terminal for ourselves and send file descriptors 1 and 2 to ``run.log``."""
        global _ACTIVE
        if not self.verbose:
            sys.stdout.flush()
            sys.stderr.flush()
            self.out = _reopen(1)
            self.err = _reopen(2)
            self._tty = self.out.isatty()
            os.environ.setdefault("PREFECT_LOGGING_COLORS", "false")  # no escape codes in the log files
            self._point_at(self.log_dir / RUN_LOG)
        _ACTIVE = self
        return self

    def close(self, restore: bool = True) -> None:
        """No longer the process's console; ``restore``: point 1 and 2 back at the terminal.

        The ``llmpipe`` process itself does not restore: what prints while the interpreter exits
        (Prefect stopping its temporary server) belongs in ``run.log``, not on the terminal.
        """
        global _ACTIVE
        self._finish_pending()
        if restore and not self.verbose:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(self.out.fileno(), 1)
            os.dup2(self.err.fileno(), 2)
        if _ACTIVE is self:
            _ACTIVE = None

    def _point_at(self, path: Path) -> None:
        if self.verbose:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)

    def stage_log(self, stage: str) -> Path:
        return self.log_dir / f"{stage}.log"

    @contextmanager
    def stage(self, stage: str) -> Iterator[Path]:
        """Output of the process goes to ``<stage>.log`` while the block runs."""
        self.current_stage = stage
        path = self.stage_log(stage)
        self._point_at(path)
        try:
            yield path
        except BaseException:
            if not self.verbose:  # the terminal gets one line; the stage's log keeps the whole story
                traceback.print_exc(file=sys.stderr)
            raise
        finally:
            self._point_at(self.log_dir / RUN_LOG)

    # -- what the user reads ------------------------------------------------------------------
    def say(self, line: str) -> None:
        self._finish_pending()
        self.out.write(line + "\n")
        self.out.flush()

    def stage_started(self, index: int, total: int, stage: str) -> None:
        """On a terminal, a line that the stage's result replaces; elsewhere nothing (no noise in CI logs)."""
        self.current_stage = stage
        if self._tty:
            self._head = f"[{index:>2}/{total}] {stage:<10}"
            self._pending = f"{self._head} running ..."
            self.out.write(self._pending)
            self.out.flush()

    def progress(self, desc: str, done: int, total: int) -> None:
        """The running stage's line says how far it is (terminal only)."""
        if self._tty and self._pending and total:
            line = f"{self._head} running ... {desc} {done}/{total}"
            self.out.write("\r" + line.ljust(len(self._pending)))
            self.out.flush()
            self._pending = line

    def stage_finished(self, index: int, total: int, row: dict[str, Any]) -> None:
        line = f"[{index:>2}/{total}] {row['stage']:<10} {row['status']:<7} {row['seconds']:>7.2f} s"
        if self._pending:
            self.out.write("\r" + line.ljust(len(self._pending)) + "\n")
            self._pending = ""
            self.out.flush()
        else:
            self.say(line)

    def error(self, message: str) -> None:
        self._finish_pending()
        self.err.write(message + "\n")
        self.err.flush()

    def _finish_pending(self) -> None:
        if self._pending:
            self.out.write("\n")
            self.out.flush()
            self._pending = ""


def _reopen(fd: int) -> IO[str]:
    """A text stream on a duplicate of ``fd`` (the terminal, before ``fd`` is pointed elsewhere)."""
    stream = sys.stdout if fd == 1 else sys.stderr
    encoding = getattr(stream, "encoding", None) or "utf-8"
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=encoding, errors="replace")


def active() -> RunConsole | None:
    """The console of the ``llmpipe run`` in this process, if one is open."""
    return _ACTIVE


@contextmanager
def stage_output(stage: str) -> Iterator[Path | None]:
    """The stage's output goes to its log file when a console is open; otherwise nothing changes."""
    console = _ACTIVE
    if console is None:
        yield None
        return
    with console.stage(stage) as path:
        yield path
