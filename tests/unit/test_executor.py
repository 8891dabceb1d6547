"""LocalExecutor: in-process, process-pool and thread-pool maps; gc_paused across threads."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from llmpipe.executor import LocalExecutor
from llmpipe.memory import gc_paused

_MEET = threading.Barrier(2)


def _pid_and_meet(x: int) -> tuple[int, int]:
    _MEET.wait(timeout=10)  # only returns if two items run at the same time
    return x * x, os.getpid()


def _fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("item 3 is bad")
    return x


def test_threads_run_items_at_once_in_this_process_in_order() -> None:
    _MEET.reset()
    done: list[int] = []
    out = LocalExecutor(2).map(_pid_and_meet, [1, 2, 3, 4], on_done=done.append, threads=True)
    assert [v for v, _ in out] == [1, 4, 9, 16]
    assert {pid for _, pid in out} == {os.getpid()}
    assert done == [1, 2, 3, 4]


def test_processes_unless_threads_asked_for() -> None:
    out = LocalExecutor(2).map(_square_pid, [1, 2, 3])
    assert [v for v, _ in out] == [1, 4, 9]
    assert os.getpid() not in {pid for _, pid in out}


def _square_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


@pytest.mark.parametrize("threads", [False, True])
def test_an_item_error_reaches_the_caller(threads: bool) -> None:
    with pytest.raises(ValueError, match="item 3 is bad"):
        LocalExecutor(2).map(_fail_on_three, [1, 2, 3, 4], threads=threads)


def test_gc_paused_from_overlapping_threads_restores_the_collector() -> None:
    assert gc.isenabled()
    entered, release = threading.Barrier(3), threading.Event()

    def hold() -> None:
        with gc_paused():
            entered.wait(timeout=10)
            release.wait(timeout=10)

    first = threading.Thread(target=hold)
    second = threading.Thread(target=hold)
    first.start()
    second.start()
    entered.wait(timeout=10)
    assert not gc.isenabled()
    release.set()
    first.join()
    second.join()
    assert gc.isenabled()  # the last one out re-enables, whichever order they left in
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()
