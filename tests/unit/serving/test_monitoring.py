"""deployments/monitoring/: the alert rules, Alertmanager route and Grafana dashboard pass Prometheus'
own checkers, and (slow) a real Triton + Prometheus + Alertmanager on 127.0.0.1 see the error-rate
alert fire at a webhook after a burst of refused requests."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from llmpipe.serving import monitoring
from llmpipe.serving import server as srv
from llmpipe.serving.client import TextClient
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.repository import write_model_repository

ROOT = Path(__file__).resolve().parents[3] / "deployments" / "monitoring"
RULES = ROOT / "alerts.yml"
DASHBOARD = ROOT / "grafana" / "llmpipe-serving.json"
needs_promtool = pytest.mark.skipif(monitoring.promtool_binary() is None,
                                    reason="promtool not installed (scripts/install.sh --test installs prometheus)")


def _check(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


@needs_promtool
def test_every_rule_file_passes_promtool() -> None:
    files = sorted(ROOT.rglob("*.yml"))
    rule_files = [f for f in files if "groups" in (yaml.safe_load(f.read_text()) or {})]
    assert RULES in rule_files
    out = _check(["promtool", "check", "rules", *map(str, rule_files)])
    assert "SUCCESS: 7 rules found" in out
    names = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert names == {"TritonDown", "TritonErrorRateHigh", "TritonP99LatencyOverSlo", "TritonQueueTimeHigh",
                     "ApiDown", "StreamTimeToFirstTokenOverSlo", "StreamInterTokenLatencyOverSlo"}


@needs_promtool
def test_alert_rules_fire_on_synthetic_series() -> None:
    # alerts_test.yml: refused requests (Triton's successes) make the error rate, a model without our
    # counter still alerts on Triton's failures, 1% does not alert; down, p99 over the SLO, queue time
    out = _check(["promtool", "test", "rules", str(ROOT / "alerts_test.yml")])
    assert "SUCCESS" in out
    tested = set(re.findall(r"alertname: (\w+)", (ROOT / "alerts_test.yml").read_text()))
    assert tested == {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def test_synthetic_histograms_have_the_apis_bucket_bounds() -> None:
    # alerts_test.yml's series are shaped as the API exports them: every `le` is one of its bounds
    from llmpipe.serving.openai_api import ITL_BUCKETS, TTFT_BUCKETS

    bounds = {"llmpipe_api_time_to_first_token_seconds_bucket": TTFT_BUCKETS,
              "llmpipe_api_inter_token_latency_seconds_bucket": ITL_BUCKETS}
    seen = set()
    for case in yaml.safe_load((ROOT / "alerts_test.yml").read_text())["tests"]:
        for series in case["input_series"]:
            m = re.match(r'(\w+)\{.*le="([^"]+)"', series["series"])
            if m and m.group(1) in bounds:
                seen.add(m.group(1))
                assert m.group(2) == "+Inf" or float(m.group(2)) in bounds[m.group(1)], series["series"]
    assert seen == set(bounds)


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # promtool parses a recording rule's expression like Prometheus does: one rule per panel query
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"llmpipe:panel_{i}", "expr": e}
                                                        for i, e in enumerate(dashboard_exprs())]}]}
    (tmp_path / "panels.yml").write_text(yaml.safe_dump(rules))
    _check(["promtool", "check", "rules", str(tmp_path / "panels.yml")])


def test_dashboard_shows_what_the_alerts_watch() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "llmpipe-serving" and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    shown = " ".join(dashboard_exprs())
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    for rule in rules:
        for metric in set(re.findall(r"\b(nv_[a-z_]+|llmpipe_[a-z_]+|up)\b", rule["expr"])):
            assert metric in shown, f"{rule['alert']} watches {metric}, which no dashboard panel shows"


@pytest.mark.skipif(monitoring.alertmanager_binary() is None, reason="alertmanager not installed")
def test_alertmanager_routes_to_a_webhook(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "alertmanager.yml").read_text())
    assert cfg["route"]["receiver"] == "webhook"
    assert [r["webhook_configs"][0]["url"] for r in cfg["receivers"] if r["name"] == "webhook"]
    _check(["amtool", "check-config", str(ROOT / "alertmanager.yml")])
    local = monitoring.alertmanager_config(ROOT / "alertmanager.yml", "http://127.0.0.1:1/alerts", "1s")
    assert local["receivers"][0]["webhook_configs"][0]["url"] == "http://127.0.0.1:1/alerts"


@needs_promtool
def test_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]  # where compose mounts alerts.yml
    cfg["rule_files"] = [str(RULES)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    _check(["promtool", "check", "config", str(tmp_path / "prometheus.yml")])


def test_parse_metrics_reads_triton_text_format() -> None:
    text = ('# HELP nv_inference_request_success Number of successful inference requests\n'
            '# TYPE nv_inference_request_success counter\n'
            'nv_inference_request_success{model="lm",version="1"} 617\n'
            'nv_inference_request_failure{model="lm",reason="BACKEND",version="1"} 1\n'
            'nv_inference_request_failure{model="lm",reason="REJECTED",version="1"} 2\n'
            'nv_inference_request_summary_us{model="lm",version="1",quantile="0.99"} Nan\n'
            'nv_cache_util 1.4e-05\n')
    samples = monitoring.parse_metrics(text)
    assert monitoring.metric_sum(samples, "nv_inference_request_success", model="lm") == 617
    assert monitoring.metric_sum(samples, "nv_inference_request_failure", model="lm") == 3
    assert monitoring.metric_sum(samples, "nv_inference_request_failure", reason="REJECTED") == 2
    assert monitoring.metric_sum(samples, "nv_cache_util") == pytest.approx(1.4e-05)
    q = next(s for s in samples if s.name == "nv_inference_request_summary_us")
    assert q.labels["quantile"] == "0.99" and q.value != q.value  # NaN


# -- end to end --------------------------------------------------------------------------------------
def _fast_rules(tmp_path: Path) -> Path:
    """The shipped rules, unchanged but for ``for:`` (a test cannot wait minutes for an alert)."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = tmp_path / "alerts.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def _wait(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001 - a small local helper
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.25)


@pytest.mark.slow
@pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh")
@pytest.mark.skipif(monitoring.prometheus_binary() is None or monitoring.alertmanager_binary() is None,
                    reason="prometheus / alertmanager not installed (scripts/install.sh --test)")
def test_error_rate_alert_fires_at_the_webhook(tmp_path: Path, tiny_checkpoint: Path) -> None:
    model = "alert_lm"
    write_model_repository(tiny_checkpoint, tmp_path / "repo", DeployConfig(model_name=model, streaming=False), 1)
    with srv.serve(tmp_path / "repo") as triton, \
            monitoring.monitor(tmp_path / "mon", [f"127.0.0.1:{triton.metrics_port}"], [_fast_rules(tmp_path)],
                               ROOT / "alertmanager.yml", scrape_interval="1s", evaluation_interval="1s",
                               group_wait="1s") as mon:
        procs = [mon.prometheus.process, mon.alertmanager.process]
        _wait(mon.prometheus.targets_up, 30, "Prometheus never scraped Triton")
        with TextClient(triton.http_url, model, "http") as c:
            for i in range(20):  # good traffic first: the alert must stay quiet
                c.generate(prompt=f"request {i}", max_tokens=2)
            _wait(lambda: mon.prometheus.query(f'nv_inference_request_success{{model="{model}"}} >= 20'), 15,
                  "the good requests never reached Prometheus")
            time.sleep(2.5)  # two evaluations on good traffic
            assert not [a for a in mon.prometheus.alerts() if a["labels"]["alertname"] == "TritonErrorRateHigh"]
            for i in range(10):  # then a burst the model refuses (HTTP 400)
                with pytest.raises(Exception, match="'prompt' is empty"):
                    c.generate(prompt=" " * (i + 1), max_tokens=2)
        note = mon.webhook.wait_firing("TritonErrorRateHigh", 45)
        alert = next(a for a in note["alerts"] if a["labels"]["alertname"] == "TritonErrorRateHigh")
        assert alert["labels"]["model"] == model and alert["labels"]["severity"] == "critical"
        assert "of requests fail" in alert["annotations"]["summary"]
        assert "TritonDown" not in mon.webhook.firing()
        # Triton alone would not see it: the refusals are successes to it, our counter has them
        samples = monitoring.read_metrics(triton.metrics_url)
        assert monitoring.metric_sum(samples, "nv_inference_request_failure", model=model) == 0
        assert monitoring.metric_sum(samples, "llmpipe_request_errors_total", model=model) == 10
        for expr in dashboard_exprs():  # every panel's query runs on the real Prometheus
            mon.prometheus.query(expr)
        pids = [p.pid for p in procs]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert all(not p.leftovers() for p in procs)


def test_compose_runs_the_monitoring_stack_on_these_files() -> None:
    compose_dir = ROOT.parent / "triton"
    services = yaml.safe_load((compose_dir / "docker-compose.yml").read_text())["services"]
    mounts = {name: {v.split(":")[1]: (compose_dir / v.split(":")[0]).resolve() for v in svc.get("volumes", [])}
              for name, svc in services.items() if name in ("prometheus", "alertmanager", "grafana")}
    for name, m in mounts.items():
        assert all(p.exists() for p in m.values()), f"{name} mounts a file that does not exist: {m}"
    prom = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    assert mounts["prometheus"]["/etc/prometheus/prometheus.yml"] == ROOT / "prometheus.yml"
    assert all(mounts["prometheus"][r] == ROOT / Path(r).name for r in prom["rule_files"])
    replicas = sorted(s for s in services if s.startswith("triton-"))
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert sorted(jobs["triton"]) == [f"{r}:8002" for r in replicas]  # every replica, not nginx's balanced port
    apis = sorted(s for s in services if s.startswith("api-"))
    assert len(apis) == len(replicas) and sorted(jobs["api"]) == [f"{a}:8080" for a in apis]
    for job, targets in jobs.items():  # every target is a compose service that exposes the port scraped
        for host, port in (t.split(":") for t in targets):
            assert host in services and port in services[host]["expose"], f"job {job}: {host}:{port} is not in compose"
    for a, r in zip(apis, replicas, strict=True):  # each API fronts its own replica, so its histograms are that replica's
        assert services[a]["command"][services[a]["command"].index("--triton") + 1] == f"{r}:8001"
    am_host, am_port = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"][0].split(":")
    assert am_host in services and f"{am_port}:{am_port}" in services[am_host]["ports"]
    assert mounts["alertmanager"]["/etc/alertmanager/alertmanager.yml"] == ROOT / "alertmanager.yml"
    source = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090"
    uids = {t["datasource"]["uid"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/llmpipe.yml").read_text())["providers"][0]
    assert mounts["grafana"][f"{provider['options']['path']}/{DASHBOARD.name}"] == DASHBOARD
