"""Monitoring beside a Triton server: Prometheus scrapes its metrics and evaluates the alert rules of
``deployments/monitoring/``, Alertmanager routes what fires to a webhook.

Triton exports Prometheus metrics on its metrics port (8002 in production): request counts
(``nv_inference_request_success`` / ``_failure``), latency and queue time (cumulative counters, and
quantiles with ``--metrics-config=summary_latencies=true``), the response cache's hits and misses,
and the model's own counters (``llmpipe_request_errors_total``: requests it refused, which Triton
counts as successes). ``llmpipe serve --monitor`` runs Prometheus and Alertmanager (Debian's
``prometheus`` and ``prometheus-alertmanager`` packages; ``scripts/install.sh --test`` installs
them) on 127.0.0.1 next to the server, with a webhook receiver of ours that prints every alert.
Every process is started through :mod:`llmpipe.processes`, so it ends with its parent.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from llmpipe.processes import ManagedProcess, free_port, wait_for_http

ALERTMANAGER_BINARIES = ("alertmanager", "prometheus-alertmanager")  # upstream name, Debian's name


# -- Triton's metrics endpoint ----------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One line of the Prometheus text format: ``name{labels} value``."""

    name: str
    labels: dict[str, str]
    value: float


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments skipped; NaN stays NaN)."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append(Sample(m.group(1), labels, float(m.group(3).replace("Nan", "nan"))))
    return out


def read_metrics(url: str, timeout_s: float = 10.0) -> list[Sample]:
    """Scrape ``url`` (``http://127.0.0.1:8002/metrics``) once."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - a local metrics port
        return parse_metrics(r.read().decode())


def metric_sum(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples whose labels include ``labels`` (0.0 if none)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# -- Prometheus and Alertmanager --------------------------------------------------------------------
def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def alertmanager_binary() -> str | None:
    return next((p for p in map(shutil.which, ALERTMANAGER_BINARIES) if p), None)


def promtool_binary() -> str | None:
    return shutil.which("promtool")


def _need(binary: str | None, what: str) -> str:
    if binary is None:
        raise FileNotFoundError(f"{what} is not installed (Debian: apt-get install --no-install-recommends "
                                f"prometheus prometheus-alertmanager; scripts/install.sh --test does it)")
    return binary


def prometheus_config(targets: list[str], rule_files: list[Path], alertmanager: str | None = None,
                      scrape_interval: str = "15s", evaluation_interval: str = "15s",
                      api_targets: list[str] | None = None) -> dict[str, Any]:
    """A Prometheus config scraping Triton's metrics ``targets`` (host:port) as job ``triton`` and the
    OpenAI API's ``api_targets`` (its /metrics) as job ``api``, the jobs alerts.yml names."""
    jobs = [{"job_name": "triton", "static_configs": [{"targets": list(targets)}]}]
    if api_targets:
        jobs.append({"job_name": "api", "metrics_path": "/metrics", "static_configs": [{"targets": list(api_targets)}]})
    cfg: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": jobs,
    }
    if alertmanager is not None:
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    return cfg


@dataclass
class Prometheus:
    """A running Prometheus: its address and its HTTP API."""

    url: str
    process: ManagedProcess

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as r:  # noqa: S310 - loopback
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on a bad expression)."""
        return self._get("/api/v1/query", query=expr)["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts."""
        return self._get("/api/v1/alerts")["alerts"]

    def targets_up(self) -> bool:
        return bool(self.query('up{job="triton"} == 1'))


@contextmanager
def run_prometheus(workdir: Path, config: dict[str, Any], port: int = 0,
                   timeout_s: float = 60.0) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1 with ``config``, its data under ``workdir``; stopped when the block ends."""
    with _service("prometheus", _need(prometheus_binary(), "prometheus"), workdir, config, port, timeout_s,
                  "--storage.tsdb.path") as (url, proc):
        yield Prometheus(url, proc)


@dataclass
class Alertmanager:
    url: str
    process: ManagedProcess

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=10) as r:  # noqa: S310 - loopback
            return json.loads(r.read())


def alertmanager_config(shipped: Path, webhook_url: str, group_wait: str | None = None) -> dict[str, Any]:
    """The shipped Alertmanager config with every webhook pointed at ``webhook_url`` (and, for a short
    local run, the route's ``group_wait`` shortened)."""
    cfg = yaml.safe_load(Path(shipped).read_text())
    for receiver in cfg.get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook_url
    if group_wait is not None:
        cfg["route"]["group_wait"] = group_wait
    return cfg


@contextmanager
def run_alertmanager(workdir: Path, config: dict[str, Any], port: int = 0,
                     timeout_s: float = 60.0) -> Iterator[Alertmanager]:
    """Alertmanager on 127.0.0.1 (no cluster port) with ``config``; stopped when the block ends."""
    with _service("alertmanager", _need(alertmanager_binary(), "alertmanager"), workdir, config, port, timeout_s,
                  "--storage.path", "--cluster.listen-address=") as (url, proc):
        yield Alertmanager(url, proc)


@contextmanager
def _service(name: str, exe: str, workdir: Path, config: dict[str, Any], port: int, timeout_s: float,
             storage_flag: str, *extra: str) -> Iterator[tuple[str, ManagedProcess]]:
    """A Prometheus-family server on 127.0.0.1: its config and data under ``workdir``, ready on return,
    stopped (with anything it started) when the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / f"{name}.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    port = port or free_port()
    cmd = [exe, f"--config.file={workdir / f'{name}.yml'}", f"{storage_flag}={workdir / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", *extra, "--log.level=warn"]
    with ManagedProcess(cmd, workdir / f"{name}.log", name=name) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/-/ready", timeout_s, proc)
        yield url, proc


# -- a webhook receiver: what Alertmanager sends, collected (and printed by `llmpipe serve`) ----------
@dataclass
class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that keeps every Alertmanager notification (webhook JSON) it gets."""

    on_notification: Callable[[dict[str, Any]], None] | None = None
    notifications: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with receiver.lock:
                    receiver.notifications.append(body)
                if receiver.on_notification is not None:
                    receiver.on_notification(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                """Quiet: notifications are reported through on_notification."""

        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def firing(self) -> set[str]:
        """Names of the alerts notified as firing so far."""
        with self.lock:
            return {a["labels"]["alertname"] for n in self.notifications for a in n.get("alerts", [])
                    if a.get("status") == "firing"}

    def wait_firing(self, alertname: str, timeout_s: float) -> dict[str, Any]:
        """The first firing notification of ``alertname``; TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                for n in self.notifications:
                    if any(a["labels"].get("alertname") == alertname and a.get("status") == "firing"
                           for a in n.get("alerts", [])):
                        return n
            time.sleep(0.2)
        raise TimeoutError(f"no firing {alertname} notification within {timeout_s:.0f}s "
                           f"(got {sorted(self.firing())})")


def describe(notification: dict[str, Any]) -> str:
    """One line per alert of a webhook notification, for the console."""
    lines = []
    for a in notification.get("alerts", []):
        labels = a.get("labels", {})
        summary = a.get("annotations", {}).get("summary", "")
        lines.append(f"ALERT {a.get('status', '?')}: {labels.get('alertname', '?')} "
                     f"[{labels.get('severity', '-')}] {summary}")
    return "\n".join(lines)


@dataclass
class Monitoring:
    prometheus: Prometheus
    alertmanager: Alertmanager
    webhook: WebhookReceiver


@contextmanager
def monitor(workdir: Path, metrics_targets: list[str], rules: list[Path], alertmanager_yml: Path,
            scrape_interval: str = "5s", evaluation_interval: str = "5s", group_wait: str | None = None,
            on_notification: Callable[[dict[str, Any]], None] | None = None, prometheus_port: int = 0,
            alertmanager_port: int = 0, api_targets: list[str] | None = None) -> Iterator[Monitoring]:
    """Webhook receiver, Alertmanager routing to it, Prometheus scraping ``metrics_targets`` (and the
    OpenAI API's ``api_targets``) with ``rules`` and alerting through that Alertmanager; everything
    stops when the block ends."""
    with WebhookReceiver(on_notification) as hook, \
            run_alertmanager(workdir / "alertmanager", alertmanager_config(alertmanager_yml, hook.url, group_wait),
                             alertmanager_port) as am:
        prom_cfg = prometheus_config(metrics_targets, rules, am.url.split("://", 1)[1],
                                     scrape_interval, evaluation_interval, api_targets)
        with run_prometheus(workdir / "prometheus", prom_cfg, prometheus_port) as prom:
            yield Monitoring(prom, am, hook)
