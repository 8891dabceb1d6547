"""Helpers shared by the benchmark scripts (timing, result line)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def result(metric: str, value: float, op: str, target: float) -> None:
    """The last line every benchmark prints: ``RESULT <metric> <value> goal <op> <target>``."""
    print(f"RESULT {metric} {value:.3f} goal {op} {target:g}")
