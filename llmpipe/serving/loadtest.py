"""Smoke and load tests against a running Triton server, loopback only, bounded in requests and time.

The load test reports latency percentiles, throughput and the server's own batch-size histogram
(model statistics API, diffed before/after so only this run counts), and raises SloViolation when
p99 is over the objective, which fails the release. The figures are measurements of one run: the
deploy stage keeps them in its manifest's stats; ``out_path`` writes them to a file of the caller's
(a benchmark's), never into an artifact.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.serving.client import Protocol, TextClient

DEFAULT_PROMPTS = (
    "The quick brown fox", "Once upon a time", "In the beginning the data was",
    "A language model is", "Pipelines turn raw text into", "The weather today",
    "Numbers like 12345 and", "Sehr geehrte Damen und Herren",
)


class SloViolation(RuntimeError):
    """p99 latency over the configured objective."""


def _loopback(url: str) -> None:
    host = url.split("://")[-1].rsplit(":", 1)[0]
    if host not in ("127.0.0.1", "localhost", "[::1]", "::1"):
        raise ValueError(f"load tests run against loopback servers only, got {url!r}")


def smoke_test(url: str, model: str, protocol: Protocol = "http", prompt: str = "Hello",
               max_tokens: int = 4) -> dict[str, Any]:
    """One request by text and one by ids; raises on any error or malformed answer."""
    _loopback(url)
    with TextClient(url, model, protocol) as c:
        t0 = time.perf_counter()
        g = c.generate(prompt=prompt, max_tokens=max_tokens)
        ms = (time.perf_counter() - t0) * 1000
        if not 1 <= len(g.output_ids) <= max_tokens:
            raise RuntimeError(f"smoke test ({protocol}): expected 1..{max_tokens} tokens, got {g.output_ids}")
        g2 = c.generate(input_ids=g.output_ids[:1] or [0], max_tokens=1)
        if len(g2.output_ids) != 1:
            raise RuntimeError(f"smoke test ({protocol}): ids request returned {g2.output_ids}")
    return {"protocol": protocol, "ok": True, "latency_ms": round(ms, 2), "tokens": len(g.output_ids)}


def batch_histogram(stats: dict[str, Any], model: str) -> dict[int, int]:
    """{batch size: executions} from a model-statistics answer (HTTP or gRPC JSON form)."""
    for m in stats.get("model_stats", []):
        if m.get("name") == model:
            return {int(b["batch_size"]): int(b.get("compute_infer", {}).get("count", 0))
                    for b in m.get("batch_stats", [])}
    return {}


def _settled_histogram(c: TextClient, model: str, before: dict[int, int], done: int,
                       wait_s: float = 5.0) -> dict[int, int]:
    """This run's batch histogram. The server records a batch's statistics just after answering it,
    so the last batch can be missing for a moment: poll until every answered request is counted."""
    deadline = time.monotonic() + wait_s
    while True:
        after = batch_histogram(c.statistics(), model)
        hist = {b: n - before.get(b, 0) for b, n in sorted(after.items()) if n - before.get(b, 0) > 0}
        if sum(b * n for b, n in hist.items()) >= done or time.monotonic() > deadline:
            return hist
        time.sleep(0.05)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def load_test(url: str, model: str, *, protocol: Protocol = "grpc", clients: int = 4, requests: int = 64,
              max_seconds: float = 60.0, max_tokens: int = 8, prompts: tuple[str, ...] = DEFAULT_PROMPTS,
              slo_p99_ms: float | None = None, out_path: Path | None = None) -> dict[str, Any]:
    """``clients`` threads send greedy requests until ``requests`` are done or ``max_seconds`` pass."""
    _loopback(url)
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    issued = [0]
    deadline = time.monotonic() + max_seconds

    def take() -> int | None:
        with lock:
            if issued[0] >= requests or time.monotonic() > deadline:
                return None
            issued[0] += 1
            return issued[0] - 1

    def worker() -> None:
        with TextClient(url, model, protocol) as c:
            while (i := take()) is not None:
                t0 = time.perf_counter()
                try:
                    c.generate(prompt=prompts[i % len(prompts)], max_tokens=max_tokens)
                except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                    with lock:
                        errors.append(str(e)[:200])
                    continue
                with lock:
                    lat.append((time.perf_counter() - t0) * 1000)

    with TextClient(url, model, protocol) as c:
        before = batch_histogram(c.statistics(), model)
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        hist = _settled_histogram(c, model, before, len(lat))
    execs = sum(hist.values())
    result = {
        "protocol": protocol, "clients": clients, "requests": len(lat), "errors": len(errors),
        "error_samples": errors[:3], "seconds": round(wall, 3), "max_tokens": max_tokens,
        "p50_ms": round(percentile(lat, 50), 2), "p95_ms": round(percentile(lat, 95), 2),
        "p99_ms": round(percentile(lat, 99), 2), "mean_ms": round(float(np.mean(lat)), 2) if lat else None,
        "throughput_rps": round(len(lat) / wall, 2) if wall > 0 else 0.0,
        "batch_histogram": {str(b): n for b, n in hist.items()},
        "mean_batch_size": round(sum(b * n for b, n in hist.items()) / execs, 2) if execs else 0.0,
        "slo_p99_ms": slo_p99_ms,
    }
    result["slo_ok"] = bool(lat) and not errors and (slo_p99_ms is None or result["p99_ms"] <= slo_p99_ms)
    if out_path is not None:
        Path(out_path).write_text(json.dumps(result, indent=2) + "\n")
    if errors:
        raise RuntimeError(f"load test: {len(errors)} of {len(errors) + len(lat)} requests failed, "
                           f"e.g. {errors[0]}")
    if slo_p99_ms is not None and result["p99_ms"] > slo_p99_ms:
        raise SloViolation(f"load test: p99 {result['p99_ms']} ms > deploy.slo_p99_ms {slo_p99_ms} ms "
                           f"({clients} clients, {protocol}, p50 {result['p50_ms']} ms)")
    return result
