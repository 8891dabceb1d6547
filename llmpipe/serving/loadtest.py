"""Smoke and load tests against a running Triton server, loopback only, bounded in requests and time.

The load test reports latency percentiles, throughput and the server's own batch-size histogram
(model statistics API, diffed before/after so only this run counts), and raises SloViolation when
p99 is over the objective, which fails the release. The streaming load test (``stream_load_test``)
measures what serving users quote, per concurrency level: time to first token, inter-token latency,
end-to-end latency (p50/p90/p99), output tokens/s and requests/s (definitions below, as GenAI-Perf's). The figures are measurements of one run: the
deploy stage keeps them in its manifest's stats; ``out_path`` writes them to a file of the caller's
(a benchmark's), never into an artifact.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
               max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    """One request by text and one by ids (``stream``: read as a stream of tokens, the streaming
    model's way); raises on any error or malformed answer."""
    _loopback(url)
    with TextClient(url, model, protocol) as c:
        t0 = time.perf_counter()
        ids = _ask(c, stream, max_tokens, prompt=prompt)
        ms = (time.perf_counter() - t0) * 1000
        if not 1 <= len(ids) <= max_tokens:
            raise RuntimeError(f"smoke test ({model}, {protocol}): expected 1..{max_tokens} tokens, got {ids}")
        again = _ask(c, stream, 1, input_ids=ids[:1] or [0])
        if len(again) != 1:
            raise RuntimeError(f"smoke test ({model}, {protocol}): ids request returned {again}")
    return {"protocol": protocol, "model": model, "stream": stream, "ok": True, "latency_ms": round(ms, 2),
            "tokens": len(ids)}


def api_smoke_test(base_url: str, model: str, api_key: str | None = None, prompt: str = "Hello",
                   max_tokens: int = 4) -> list[dict[str, Any]]:
    """The OpenAI-compatible API (``base_url``: ``http://127.0.0.1:PORT/v1``): ``/v1/models`` names the
    model, a greedy ``/v1/completions`` answers with usage and finish_reason, and the same request
    streamed (server-sent events ending ``data: [DONE]``) adds up to the same text; raises on any
    deviation. Plain HTTP (urllib), the way any client sends it."""
    _loopback(base_url.split("/v1")[0])
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    listed = json.loads(_http(f"{base_url}/models", None, headers))
    if [m["id"] for m in listed["data"]] != [model]:
        raise RuntimeError(f"smoke test (OpenAI API): /v1/models lists {listed['data']}, expected {model!r}")
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    whole = json.loads(_http(f"{base_url}/completions", body, headers))
    ms = (time.perf_counter() - t0) * 1000
    choice, usage = whole["choices"][0], whole["usage"]
    if not 1 <= usage["completion_tokens"] <= max_tokens or choice["finish_reason"] not in ("stop", "length"):
        raise RuntimeError(f"smoke test (OpenAI API): unexpected answer {whole}")
    t0 = time.perf_counter()
    events = _http(f"{base_url}/completions", {**body, "stream": True}, headers).decode().split("\n\n")
    stream_ms = (time.perf_counter() - t0) * 1000
    data = [e[len("data: "):] for e in events if e.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        raise RuntimeError(f"smoke test (OpenAI API): the stream did not end with data: [DONE]: {data[-3:]}")
    chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
    text = "".join(c["text"] for c in chunks)
    if text != choice["text"] or chunks[-1]["finish_reason"] != choice["finish_reason"]:
        raise RuntimeError(f"smoke test (OpenAI API): streamed {text!r} ({chunks[-1]['finish_reason']}), "
                           f"answered {choice['text']!r} ({choice['finish_reason']})")
    return [{"protocol": "openai", "model": model, "stream": stream, "ok": True, "latency_ms": round(v, 2),
             "tokens": usage["completion_tokens"]} for stream, v in ((False, ms), (True, stream_ms))]


def _http(url: str, body: dict[str, Any] | None, headers: dict[str, str], timeout_s: float = 60.0) -> bytes:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - a loopback URL (checked)
            return r.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"smoke test (OpenAI API): {url} answered {e.code}: {e.read().decode(errors='replace')}") from None


def _ask(c: TextClient, stream: bool, max_tokens: int, **what: Any) -> list[int]:
    if not stream:
        return c.generate(max_tokens=max_tokens, **what).output_ids
    chunks = list(c.stream(max_tokens=max_tokens, **what))
    if not chunks or not chunks[-1].final:
        raise RuntimeError(f"smoke test ({c.model}): the stream ended without a final response")
    return [t for ch in chunks for t in ch.output_ids]


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


def run_clients(worker: Callable[[Callable[[], None]], None], clients: int, setup_timeout_s: float = 60.0) -> float:
    """``clients`` threads running ``worker(ready)`` at once; the wall-clock seconds from the moment
    every worker called ``ready()`` (its connection made, its requests built) until the last one ends.

    Opening 8 connections took longer than a batch of 8 answers on the tiny model: counted, it would
    read as serving time, and more so for the faster of two models compared. A worker that fails
    before ``ready()`` releases the others (the clock then starts at once).
    """
    gate = threading.Barrier(clients + 1)

    def run() -> None:
        try:
            worker(lambda: _pass(gate, setup_timeout_s))
        finally:
            gate.abort()  # after ready() a no-op for the others; before it, nobody waits for this one

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    _pass(gate, setup_timeout_s)
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _pass(gate: threading.Barrier, timeout_s: float) -> None:
    with contextlib.suppress(threading.BrokenBarrierError):
        gate.wait(timeout_s)


def _connected(c: TextClient, errors: list[str], lock: threading.Lock, stream: bool = False) -> bool:
    """Open a worker's connection (and its gRPC stream) before the clock starts; a failure is the
    worker's one error."""
    try:
        c.connect()
        if stream:
            c.open_stream()
    except Exception as e:  # noqa: BLE001 - counted and reported like a failed request
        with lock:
            errors.append(f"connecting: {str(e)[:200]}")
        return False
    return True


class Tickets:
    """Request numbers for the client threads, until ``requests`` are handed out or ``deadline`` passes."""

    def __init__(self, requests: int, deadline: float) -> None:
        self.requests, self.deadline, self.issued = requests, deadline, 0
        self.lock = threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            if self.issued >= self.requests or time.monotonic() > self.deadline:
                return None
            self.issued += 1
            return self.issued - 1


def load_test(url: str, model: str, *, protocol: Protocol = "grpc", clients: int = 4, requests: int = 64,
              max_seconds: float = 60.0, max_tokens: int = 8, prompts: tuple[str, ...] = DEFAULT_PROMPTS,
              slo_p99_ms: float | None = None, out_path: Path | None = None) -> dict[str, Any]:
    """``clients`` threads send greedy requests until ``requests`` are done or ``max_seconds`` pass."""
    _loopback(url)
    lat: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    tickets = Tickets(requests, time.monotonic() + max_seconds)

    def worker(ready: Callable[[], None]) -> None:
        with TextClient(url, model, protocol) as c:
            prepared = [c.prepare(prompt=p, max_tokens=max_tokens) for p in prompts]  # the client's share of
            if not _connected(c, errors, lock):  # the 2 cores go to sending, not to building tensors
                return  # or connecting
            ready()
            while (i := tickets.take()) is not None:
                t0 = time.perf_counter()
                try:
                    c.generate(prepared=prepared[i % len(prompts)])
                except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                    with lock:
                        errors.append(str(e)[:200])
                    continue
                with lock:
                    lat.append((time.perf_counter() - t0) * 1000)

    with TextClient(url, model, protocol) as c:
        before = batch_histogram(c.statistics(), model)
        wall = run_clients(worker, clients)
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


# -- streaming: the figures serving users quote ----------------------------------------------------
# Definitions (as NVIDIA's GenAI-Perf / AIPerf define them; the README repeats them):
#   TTFT   time to first token: from sending a request to receiving its first token
#   ITL    inter-token latency: (e2e - TTFT) / (output tokens - 1), one value per request of 2+ tokens
#   e2e    end-to-end request latency: from sending a request to receiving its final response
#   output tokens/s  all output tokens of a level / the level's wall time (first send to last answer)
#   requests/s       answered requests of a level / the level's wall time
STREAM_FIGURES = ("ttft", "itl", "e2e")
SLO_FIGURES = STREAM_FIGURES
QUANTILES = (50, 90, 99)


@dataclass
class StreamRecord:
    """The client-side timestamps of one streamed request (time.perf_counter seconds)."""

    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per response that carried tokens
    tokens: int = 0

    @property
    def ttft_ms(self) -> float:
        return (self.arrivals[0] - self.sent) * 1000

    @property
    def e2e_ms(self) -> float:
        return (self.arrivals[-1] - self.sent) * 1000

    @property
    def itl_ms(self) -> float | None:
        return (self.e2e_ms - self.ttft_ms) / (self.tokens - 1) if self.tokens > 1 else None


def stream_figures(records: list[StreamRecord], wall_s: float) -> dict[str, Any]:
    """p50/p90/p99 (and mean) of TTFT, ITL and e2e, output tokens/s and requests/s of one level."""
    done = [r for r in records if r.arrivals]
    values = {"ttft": [r.ttft_ms for r in done], "e2e": [r.e2e_ms for r in done],
              "itl": [v for r in done if (v := r.itl_ms) is not None]}
    row: dict[str, Any] = {"requests": len(done), "output_tokens": sum(r.tokens for r in done)}
    for name in STREAM_FIGURES:
        for q in QUANTILES:
            row[f"{name}_p{q}_ms"] = round(percentile(values[name], q), 3)
        row[f"{name}_mean_ms"] = round(float(np.mean(values[name])), 3) if values[name] else float("nan")
    row["output_tokens_per_s"] = round(row["output_tokens"] / wall_s, 2) if wall_s > 0 else 0.0
    row["requests_per_s"] = round(len(done) / wall_s, 2) if wall_s > 0 else 0.0
    row["seconds"] = round(wall_s, 3)
    return row


EventHook = Callable[[int, str, int], None]  # (request number, "sent" | "chunk", its tokens), for tests' clocks


def _stream_level(url: str, model: str, protocol: Protocol, concurrency: int, requests: int,
                  deadline: float, max_tokens: int, prompts: tuple[str, ...],
                  on_event: EventHook | None) -> dict[str, Any]:
    """``concurrency`` clients, each streaming one request at a time, until ``requests`` are done."""
    records: list[StreamRecord] = []
    errors: list[str] = []
    lock = threading.Lock()

    tickets = Tickets(requests, deadline)

    def worker(ready: Callable[[], None]) -> None:
        with TextClient(url, model, protocol) as c:
            prepared = [c.prepare(prompt=p, max_tokens=max_tokens) if protocol == "grpc" else None for p in prompts]
            # a first request's TTFT is the server's, not the stream's opening
            if not _connected(c, errors, lock, stream=protocol == "grpc"):
                return
            ready()
            while (i := tickets.take()) is not None:
                if on_event is not None:
                    on_event(i, "sent", 0)
                rec = StreamRecord(time.perf_counter())
                try:
                    for chunk in c.stream(prompt=prompts[i % len(prompts)], max_tokens=max_tokens,
                                          prepared=prepared[i % len(prompts)]):
                        if chunk.output_ids:
                            rec.arrivals.append(chunk.arrived)
                            rec.tokens += len(chunk.output_ids)
                            if on_event is not None:
                                on_event(i, "chunk", len(chunk.output_ids))
                except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                    with lock:
                        errors.append(str(e)[:200])
                    continue
                with lock:
                    records.append(rec)

    wall = run_clients(worker, concurrency)
    row = {"concurrency": concurrency, **stream_figures(records, wall),
           "errors": len(errors)}
    row["error_samples"] = errors[:3]
    return row


def stream_load_test(url: str, model: str, *, protocol: Protocol = "grpc",
                     concurrency: Sequence[int] = (1, 4, 8, 16), requests: int = 64, max_seconds: float = 60.0,
                     max_tokens: int = 16, prompts: tuple[str, ...] = DEFAULT_PROMPTS,
                     slo_figure: str = "e2e", slo_p99_ms: float | None = None,
                     on_event: EventHook | None = None) -> dict[str, Any]:
    """TTFT, ITL, e2e (p50/p90/p99), output tokens/s and requests/s of a streaming model, per level.

    Each concurrency level sends ``requests`` greedy requests (at most ``max_seconds`` per level).
    ``slo_p99_ms`` is checked against the p99 of ``slo_figure`` ("ttft", "itl" or "e2e") at every
    level: SloViolation names the first level over it; any failed request raises RuntimeError.
    """
    _loopback(url)
    if slo_figure not in SLO_FIGURES:
        raise ValueError(f"slo_figure must be one of {SLO_FIGURES}, got {slo_figure!r}")
    levels = [_stream_level(url, model, protocol, c, requests, time.monotonic() + max_seconds, max_tokens,
                            prompts, on_event) for c in concurrency]
    return _checked_levels(protocol, model, max_tokens, levels, slo_figure, slo_p99_ms)


def _checked_levels(protocol: str, model: str, max_tokens: int, levels: list[dict[str, Any]], slo_figure: str,
                    slo_p99_ms: float | None) -> dict[str, Any]:
    """The levels' result; RuntimeError when a request failed, SloViolation when a p99 is over the SLO."""
    key = f"{slo_figure}_p99_ms"
    worst = max((lv[key] for lv in levels), default=float("nan"))
    result = {"protocol": protocol, "model": model, "max_tokens": max_tokens, "levels": levels,
              "slo_figure": slo_figure, "slo_p99_ms": slo_p99_ms, "worst_p99_ms": worst}
    failed = [lv for lv in levels if lv["errors"]]
    result["slo_ok"] = not failed and all(lv["requests"] for lv in levels) and (
        slo_p99_ms is None or worst <= slo_p99_ms)
    if failed:
        lv = failed[0]
        raise RuntimeError(f"streaming load test: {lv['errors']} requests failed at concurrency "
                           f"{lv['concurrency']}, e.g. {lv['error_samples'][0]}")
    over = [lv for lv in levels if slo_p99_ms is not None and lv[key] > slo_p99_ms]
    if over:
        lv = over[0]
        raise SloViolation(f"streaming load test: p99 {slo_figure} {lv[key]} ms > deploy.slo_p99_ms "
                           f"{slo_p99_ms} ms at concurrency {lv['concurrency']} ({protocol}, "
                           f"p50 {lv[f'{slo_figure}_p50_ms']} ms); deploy.slo_figure names the figure")
    return result


def api_stream_level(base_url: str, model: str, *, concurrency: int, requests: int, max_tokens: int,
                     prompts: Sequence[str] = DEFAULT_PROMPTS, max_seconds: float = 60.0,
                     api_key: str | None = None) -> dict[str, Any]:
    """One streaming level through an OpenAI-compatible API (``base_url``: ``http://127.0.0.1:PORT/v1``),
    whichever engine serves it: ``concurrency`` clients, each streaming one greedy ``/v1/completions``
    at a time, until ``requests`` are done. A response's tokens are its ``usage.completion_tokens``
    (``stream_options.include_usage``), its arrivals the events that carried text; the figures are
    :func:`stream_figures`'. Plain HTTP (httpx), one connection per client, opened before the clock."""
    import httpx

    _loopback(base_url.split("/v1")[0])
    records: list[StreamRecord] = []
    errors: list[str] = []
    lock = threading.Lock()
    tickets = Tickets(requests, time.monotonic() + max_seconds)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def one(c: Any, prompt: str) -> StreamRecord:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        rec, usage = StreamRecord(time.perf_counter()), None
        with c.stream("POST", f"{base_url}/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(str(event["error"].get("message"))[:200])
                if event.get("choices") and event["choices"][0].get("text"):
                    rec.arrivals.append(time.perf_counter())
                usage = event.get("usage") or usage
        rec.tokens = int(usage["completion_tokens"]) if usage else len(rec.arrivals)
        return rec

    def worker(ready: Callable[[], None]) -> None:
        with httpx.Client(headers=headers, timeout=max(60.0, max_seconds)) as c:
            try:
                c.get(f"{base_url}/models").raise_for_status()  # the connection, before the clock starts
            except Exception as e:  # noqa: BLE001 - counted and reported like a failed request
                with lock:
                    errors.append(f"connecting: {str(e)[:200]}")
                return
            ready()
            while (i := tickets.take()) is not None:
                try:
                    rec = one(c, prompts[i % len(prompts)])
                except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
                    with lock:
                        errors.append(str(e)[:200])
                    continue
                with lock:
                    records.append(rec)

    wall = run_clients(worker, concurrency)
    return {"concurrency": concurrency, **stream_figures(records, wall), "errors": len(errors),
            "error_samples": errors[:3]}


def api_stream_load_test(base_url: str, model: str, *, concurrency: Sequence[int] = (1, 4, 8, 16),
                         requests: int = 64, max_seconds: float = 60.0, max_tokens: int = 16,
                         prompts: Sequence[str] = DEFAULT_PROMPTS, slo_figure: str = "e2e",
                         slo_p99_ms: float | None = None, api_key: str | None = None) -> dict[str, Any]:
    """:func:`stream_load_test` through an OpenAI-compatible API: the same levels, figures and checks
    for any engine behind it (ours, or vLLM's own server)."""
    if slo_figure not in SLO_FIGURES:
        raise ValueError(f"slo_figure must be one of {SLO_FIGURES}, got {slo_figure!r}")
    levels = [api_stream_level(base_url, model, concurrency=c, requests=requests, max_tokens=max_tokens,
                               prompts=prompts, max_seconds=max_seconds, api_key=api_key) for c in concurrency]
    return _checked_levels("openai", model, max_tokens, levels, slo_figure, slo_p99_ms)


def plot_levels(result: dict[str, Any], path: Path) -> Path:
    """A PNG of p50 and p99 TTFT, ITL and e2e latency against concurrency (for benchmarks: a
    measurement, so it goes to a file the caller names, never into an artifact)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    xs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, name in zip(axes, STREAM_FIGURES, strict=True):
        for q, style in ((50, "o-"), (99, "s--")):
            ax.plot(xs, [lv[f"{name}_p{q}_ms"] for lv in levels], style, label=f"p{q}")
        ax.set_title({"ttft": "time to first token", "itl": "inter-token latency", "e2e": "end to end"}[name])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']} over {result['protocol']}, {result['max_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def levels_markdown(result: dict[str, Any], width: int = 40) -> str:
    """Latency against concurrency as a markdown table with text bars (p99 of each figure), for the
    UI: it is built from the stats, so a measurement never becomes an artifact file."""
    levels = result["levels"]
    top = max((v for lv in levels for f in STREAM_FIGURES if not math.isnan(v := lv[f"{f}_p99_ms"])),
              default=0.0) or 1.0
    lines = [f"p99 latency against concurrency: {result['model']} over {result['protocol']}, "
             f"{result['max_tokens']} new tokens (bar: e2e p99, full width {top:.1f} ms)", "",
             "| clients | TTFT p50 / p99 ms | ITL p50 / p99 ms | e2e p50 / p99 ms | tokens/s | e2e p99 |",
             "| ---: | ---: | ---: | ---: | ---: | :--- |"]
    for lv in levels:
        bar = "" if math.isnan(lv["e2e_p99_ms"]) else "█" * max(1, round(width * lv["e2e_p99_ms"] / top))
        lines.append(f"| {lv['concurrency']} | {lv['ttft_p50_ms']:.1f} / {lv['ttft_p99_ms']:.1f} | "
                     f"{lv['itl_p50_ms']:.1f} / {lv['itl_p99_ms']:.1f} | {lv['e2e_p50_ms']:.1f} / "
                     f"{lv['e2e_p99_ms']:.1f} | {lv['output_tokens_per_s']:.0f} | `{bar}` |")
    return "\n".join(lines) + "\n"
