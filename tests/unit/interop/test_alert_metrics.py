"""The alert rules watch metrics that a real server exposes: ``llmpipe serve --monitor`` on a deploy
artifact of the pipeline's own quantized model streams a few answers through the OpenAI API, and every
metric name that deployments/monitoring/alerts.yml uses is on the API's (or Triton's) /metrics, the
API's with non-zero counts; the local Prometheus scrapes the API as job ``api`` and the streaming
alerts' quantiles come out as numbers. A renamed metric, label or job would leave an alert silently
blind: this fails instead."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmpipe.processes import ManagedProcess, free_ports, wait_for_http
from llmpipe.serving import monitoring
from llmpipe.serving import server as srv
from llmpipe.serving.monitoring import metric_sum, read_metrics
from tests.conftest import ROOT
from tests.unit.interop.conftest import deploy_artifact

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh"),
              pytest.mark.skipif(monitoring.prometheus_binary() is None or monitoring.alertmanager_binary() is None,
                                 reason="prometheus / alertmanager not installed (scripts/install.sh --test)")]
RULES = ROOT / "deployments" / "monitoring" / "alerts.yml"
STREAM_ALERTS = ("StreamTimeToFirstTokenOverSlo", "StreamInterTokenLatencyOverSlo")


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _names(expr: str) -> set[str]:
    """The metric names an expression reads (ours and Triton's; ``up`` is Prometheus' own)."""
    return set(re.findall(r"\b((?:nv|llmpipe)_[a-z_]+)\b", expr))




def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - loopback
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def _stream(client: Any, model: str, n: int) -> None:
    """``n`` streamed answers (completions and chat), each of several chunks."""
    for i in range(n):
        if i % 2:
            chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                         max_tokens=8, temperature=0, stream=True))
        else:
            chunks = list(client.completions.create(model=model, prompt=f"The {i}", max_tokens=8, temperature=0,
                                                    stream=True))
        assert len(chunks) >= 3, chunks


def test_every_metric_the_alerts_watch_is_served(quantize_dir: Path, tmp_path: Path) -> None:
    import openai

    deploy = deploy_artifact(quantize_dir, tmp_path / "deploy")
    http, grpc, metrics, api, prom, am = free_ports(6)
    llmpipe = Path(sys.executable).parent / "llmpipe"  # the console script, as a user runs it
    cmd = [str(llmpipe), "serve", str(deploy), "--engine", "llmpipe", "--http-port", str(http), "--grpc-port",
           str(grpc), "--metrics-port", str(metrics), "--api-port", str(api), "--monitor", "--prometheus-port",
           str(prom), "--alertmanager-port", str(am)]
    api_url, prometheus = f"http://127.0.0.1:{api}", f"http://127.0.0.1:{prom}"
    with ManagedProcess(cmd, tmp_path / "serve.log", name="llmpipe-serve") as serve:
        wait_for_http(f"{api_url}/health", timeout=300, proc=serve)
        wait_for_http(f"{prometheus}/-/ready", timeout=60, proc=serve)
        client = openai.OpenAI(base_url=f"{api_url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        _until(lambda: _query(prometheus, 'up{job="api"} == 1') and _query(prometheus, 'up{job="triton"} == 1'),
               60, "Prometheus never scraped both the API (job api) and Triton (job triton)")
        _stream(client, model, 4)

        # every name the rules read is served: the API's with counts, Triton's at least exposed
        api_samples, triton_samples = read_metrics(f"{api_url}/metrics"), read_metrics(
            f"http://127.0.0.1:{metrics}/metrics")
        for rule in _rules():
            on_api = 'job="api"' in rule["expr"]
            served = api_samples if on_api else triton_samples
            for name in _names(rule["expr"]):
                family = name.removesuffix("_bucket").removesuffix("_total")
                assert any(s.name.startswith(family) for s in served), \
                    f"{rule['alert']} reads {name}, which {'the API' if on_api else 'Triton'} does not serve"
                if on_api:
                    count = metric_sum(api_samples, name, le="+Inf") if name.endswith("_bucket") else \
                        metric_sum(api_samples, name)
                    assert count > 0, f"{rule['alert']} reads {name}, which counted nothing after 4 streams"
        assert metric_sum(api_samples, "llmpipe_api_inter_token_latency_seconds_count", model=model) >= 4 * 2

        # and Prometheus turns them into the alerts' quantiles: a rate needs two scrapes with traffic between
        _until(lambda: _query(prometheus, "llmpipe_api_inter_token_latency_seconds_count > 0"), 30,
               "Prometheus never scraped the API's inter-token histogram")
        _stream(client, model, 2)
        for name in STREAM_ALERTS:
            expr = next(r["expr"] for r in _rules() if r["alert"] == name)
            quantile = re.sub(r">\s*[\d.]+\s*$", "", expr.strip())  # the p99 itself, without the threshold

            def finite(q: str = quantile) -> bool:
                return any(math.isfinite(float(v["value"][1])) for v in _query(prometheus, q))

            _until(finite, 45, f"{name}: {quantile} never gave a number on the real server's series")
            ms = max(float(v["value"][1]) for v in _query(prometheus, quantile))
            assert 0 < ms < 60_000, (name, ms)

        # compose's api-N: `llmpipe serve --triton` is the API alone, in front of a Triton running elsewhere
        alone = free_ports(1)[0]
        cmd = [str(llmpipe), "serve", str(deploy), "--triton", f"127.0.0.1:{grpc}", "--api-port", str(alone)]
        with ManagedProcess(cmd, tmp_path / "api.log", name="llmpipe-api") as front:
            wait_for_http(f"http://127.0.0.1:{alone}/health", timeout=120, proc=front)
            _stream(openai.OpenAI(base_url=f"http://127.0.0.1:{alone}/v1", api_key="none", max_retries=0,
                                  timeout=120), model, 1)
            own = read_metrics(f"http://127.0.0.1:{alone}/metrics")
            assert metric_sum(own, "llmpipe_api_inter_token_latency_seconds_count", model=model) >= 2
            assert metric_sum(own, "llmpipe_api_time_to_first_token_seconds_count") == 1  # its own registry
            os.kill(front.pid, signal.SIGTERM)  # as compose stops it
            assert front.wait(timeout=30) == 0


def test_serve_triton_is_the_api_alone() -> None:
    llmpipe = Path(sys.executable).parent / "llmpipe"
    r = subprocess.run([str(llmpipe), "serve", ".", "--triton", "127.0.0.1:1", "--monitor"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--triton serves the API only" in r.stderr, r.stderr
