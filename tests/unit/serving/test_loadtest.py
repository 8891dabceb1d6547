"""The streaming load test's figures from known timestamps (no server): the definitions the README states."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest

from llmpipe.serving.loadtest import StreamRecord, levels_markdown, run_clients, stream_figures


def test_figures_follow_the_genai_perf_definitions() -> None:
    # sent at 0; tokens at 10, 12, 16 ms -> TTFT 10, e2e 16, ITL (16 - 10) / (3 - 1) = 3
    a = StreamRecord(0.0, [0.010, 0.012, 0.016], 3)
    # sent at 1 s; one response carrying 2 tokens at 1.030, one more at 1.040 -> ITL (40 - 30) / 2 = 5
    b = StreamRecord(1.0, [1.030, 1.040], 3)
    c = StreamRecord(2.0, [2.020], 1)  # one token: a TTFT and an e2e, no ITL
    row = stream_figures([a, b, c], wall_s=2.5)
    assert row["requests"] == 3 and row["output_tokens"] == 7
    assert row["ttft_p50_ms"] == pytest.approx(20.0) and row["ttft_mean_ms"] == pytest.approx(20.0)
    assert row["e2e_p50_ms"] == pytest.approx(20.0) and row["e2e_mean_ms"] == pytest.approx(76 / 3, abs=1e-3)
    assert row["itl_mean_ms"] == pytest.approx(4.0) and row["itl_p50_ms"] == pytest.approx(4.0)
    assert row["itl_p99_ms"] == pytest.approx(3 + 0.99 * 2, abs=1e-3)  # numpy's linear interpolation
    assert row["output_tokens_per_s"] == pytest.approx(7 / 2.5) and row["requests_per_s"] == pytest.approx(3 / 2.5)


def test_a_level_without_answers_has_no_figures_and_the_chart_says_so() -> None:
    row = stream_figures([StreamRecord(0.0)], wall_s=1.0)
    assert row["requests"] == 0 and math.isnan(row["ttft_p99_ms"]) and row["requests_per_s"] == 0
    ok = {"concurrency": 4, **stream_figures([StreamRecord(0.0, [0.01, 0.02], 2)], 1.0)}
    text = levels_markdown({"model": "m", "protocol": "http", "max_tokens": 2,
                            "levels": [{"concurrency": 1, **row}, ok]})
    lines = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert lines[0].endswith("| `` |") and lines[1].count("█") == 40


def test_the_clock_starts_when_every_client_is_ready() -> None:
    """Connecting is not serving time: workers that take 0.3 s to get ready and then 0.05 s to work
    are clocked at their work; a worker that fails before it is ready holds nobody up."""
    def worker(ready: Callable[[], None]) -> None:
        time.sleep(0.3)
        ready()
        time.sleep(0.05)

    assert 0.04 < run_clients(worker, 4) < 0.25

    def gives_up(ready: Callable[[], None]) -> None:  # a worker whose connection failed: never ready
        return

    started = time.perf_counter()
    assert run_clients(gives_up, 3, setup_timeout_s=30) < 1 and time.perf_counter() - started < 5
