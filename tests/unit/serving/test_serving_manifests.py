"""Production manifests in deployments/triton/: nginx accepts its conf, compose matches the stage's output."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from llmpipe.serving.config import DeployConfig
from llmpipe.serving.openai_api import DEFAULT_API_PORT
from llmpipe.serving.stage import PRODUCTION_PORTS, run_deploy
from llmpipe.stage import STAGES, StageContext
from llmpipe.store import ArtifactStore

ROOT = Path(__file__).resolve().parents[3] / "deployments" / "triton"


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/install.sh installs it)")
def test_nginx_accepts_the_conf(tmp_path: Path) -> None:
    # The upstream hosts only resolve inside the compose network: point them at loopback for the check.
    conf = re.sub(r"\b(triton|api)-\d+\b", "127.0.0.1", (ROOT / "nginx.conf").read_text())
    conf = conf.replace("pid /tmp/nginx.pid;", f"pid {tmp_path}/nginx.pid;")
    (tmp_path / "logs").mkdir()
    (tmp_path / "nginx.conf").write_text(conf)
    r = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "syntax is ok" in r.stderr


def test_nginx_balances_every_replica_on_every_port() -> None:
    text = (ROOT / "nginx.conf").read_text()
    replicas = sorted(s for s in compose()["services"] if s.startswith("triton-"))
    assert len(replicas) >= 2
    for port in PRODUCTION_PORTS.values():
        assert re.search(rf"listen {port}\b", text), f"nginx does not listen on {port}"
        for r in replicas:
            assert f"server {r}:{port}" in text, f"{r}:{port} missing from the upstreams"
    assert re.search(rf"listen {PRODUCTION_PORTS['grpc']} http2;", text) and "grpc_pass grpc://" in text
    apis = sorted(s for s in compose()["services"] if s.startswith("api-"))
    assert len(apis) == len(replicas) and re.search(rf"listen {DEFAULT_API_PORT};", text)
    assert all(f"server {a}:{DEFAULT_API_PORT}" in text for a in apis)


def test_compose_matches_what_the_stage_generated(tmp_path: Path, tiny_checkpoint: Path) -> None:
    cfg = DeployConfig(verify=False, target="gpu")
    out = tmp_path / "out"
    out.mkdir()
    run_deploy(StageContext(spec=STAGES["deploy"], config=cfg, pipeline=None, key="k", out=out,
                            inputs={"quantize": tiny_checkpoint}, input_keys={"quantize": "q"},
                            store=ArtifactStore(tmp_path / "store"), log=logging.getLogger("t")))
    info = json.loads((out / "deploy.json").read_text())
    env = dict(line.split("=", 1) for line in (out / "triton.env").read_text().split())
    services = compose()["services"]
    for name in (s for s in services if s.startswith("triton-")):
        svc = services[name]
        cmd = " ".join(svc["command"])
        # the default model name of the compose file is the one the stage generates, and triton.env agrees
        default_model = re.search(r"--load-model=\$\{MODEL_NAME:-([\w.-]+)\}", cmd).group(1)
        assert default_model == info["model"] == env["MODEL_NAME"]
        default_stream = re.search(r"--load-model=\$\{STREAM_MODEL_NAME:-([\w.-]+)\}", cmd).group(1)
        assert default_stream == info["stream_model"] == env["STREAM_MODEL_NAME"]
        assert (out / info["repository"] / default_stream / "config.pbtxt").is_file()
        assert (out / info["repository"] / default_model / "config.pbtxt").is_file()
        assert "KIND_GPU" in (out / info["repository"] / default_model / "config.pbtxt").read_text()
        for proto, port in info["ports"].items():
            assert f"--{proto}-port={port}" in cmd
            assert str(port) in svc["expose"]
        assert any(v.endswith(":/models:ro") for v in svc["volumes"])
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    published = {int(p.split(":")[0]) for p in services["nginx"]["ports"]}
    assert published == {*info["ports"].values(), DEFAULT_API_PORT}  # Triton's ports and the OpenAI API's
    assert services["redis"]["profiles"] == ["cache"]


# -- the compose file is one Compose accepts, with the field guide's services ------------------------

SERVICES = {"triton-0", "triton-1", "api-0", "api-1", "nginx", "redis", "prometheus", "alertmanager", "grafana"}


def _compose_command() -> list[str] | None:
    """Compose v2 (`docker compose`) where the plugin is there, else Debian's docker-compose 1.29."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.skipif(_compose_command() is None,
                    reason="neither `docker compose` nor docker-compose (scripts/install.sh --test installs it)")
def test_compose_accepts_the_file(tmp_path: Path) -> None:
    cmd = _compose_command()
    assert cmd is not None
    text = (ROOT / "docker-compose.yml").read_text()
    if cmd == ["docker-compose"]:
        # 1.29 predates the Compose spec's top-level `name:` (v2 reads it); the rest is checked as is
        assert re.search(r"^name: llmpipe-triton$", text, re.M)
        text = re.sub(r"^name: .*\n", "", text, flags=re.M)
    (tmp_path / "docker-compose.yml").write_text(text)
    # relative paths (nginx.conf, ../monitoring) resolve from deployments/triton, as in production
    base = [*cmd, "-f", str(tmp_path / "docker-compose.yml"), "--project-directory", str(ROOT)]
    repo = tmp_path / "model_repository"  # the deploy artifact's folder, as the README exports it
    repo.mkdir()
    env = {**os.environ, "MODEL_REPOSITORY": str(repo), "MODEL_NAME": "m", "STREAM_MODEL_NAME": "m_stream"}
    r = subprocess.run([*base, "--profile", "cache", "config"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    resolved = yaml.safe_load(r.stdout)["services"]
    assert set(resolved) == SERVICES
    for svc in resolved.values():  # every file a service mounts exists
        for v in svc.get("volumes", []):
            src = v["source"] if isinstance(v, dict) else v.split(":")[0]
            assert Path(src).exists(), f"{src} is mounted but missing"
    assert "--load-model=m_stream" in resolved["triton-1"]["command"]
    assert resolved["redis"]["profiles"] == ["cache"]  # the shared cache starts with --profile cache only


def test_compose_has_the_field_guide_services() -> None:
    services = compose()["services"]
    assert set(services) == SERVICES
    for name in ("prometheus", "alertmanager", "grafana"):
        for v in services[name]["volumes"]:
            assert (ROOT / v.split(":")[0]).exists(), f"{name} mounts {v}, which is not in deployments/"


# -- the GPU target's config.pbtxt has the field guide's numbers; the CPU target's did not change ------

def test_gpu_target_defaults() -> None:
    from llmpipe.serving.repository import render_config

    text = render_config(DeployConfig(target="gpu"))
    assert "instance_group [ { count: 2 kind: KIND_GPU } ]" in text
    assert "max_batch_size: 32\n" in text
    assert "max_queue_delay_microseconds: 10000 default_queue_policy { max_queue_size: 64 } }" in text
    stream = render_config(DeployConfig(target="gpu"), streaming=True)
    assert "count: 2 kind: KIND_GPU" in stream and "max_batch_size: 32\n" in stream
    # streams join the running batch between steps (in-flight): no window before their first token
    assert "max_queue_delay_microseconds: 0 }" in stream
    cpu = render_config(DeployConfig())
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in cpu
    assert "max_queue_delay_microseconds: 2000 default_queue_policy { max_queue_size: 64 } }" in cpu


def test_gpu_defaults_yield_to_the_config() -> None:
    cfg = DeployConfig.model_validate({"target": "gpu", "instance_count": 4, "max_queue_delay_us": 1000})
    assert (cfg.instance_count, cfg.max_queue_delay_us) == (4, 1000)
    # the CPU target's stage key is the one it always had (no GPU default leaks into it)
    assert DeployConfig(target="cpu").key_dict() == DeployConfig().key_dict()
    assert DeployConfig().key_dict()["instance_count"] == 1 and DeployConfig().max_queue_delay_us == 2000


def test_vllm_keeps_one_engine_per_gpu() -> None:
    from llmpipe.serving.repository import render_config

    cfg = DeployConfig(target="gpu", backend="vllm")
    assert cfg.instance_count == 1
    assert "count: 1 kind: KIND_MODEL" in render_config(cfg)
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization"):
        DeployConfig(target="gpu", backend="vllm", instance_count=2)
    DeployConfig(target="gpu", backend="vllm", instance_count=2, vllm_gpu_memory_utilization=0.45)


def test_nginx_streams_generate_stream_unbuffered() -> None:
    text = (ROOT / "nginx.conf").read_text()
    block = re.search(r"location ~ (\S+) \{([^}]*)\}", text)
    assert block and "proxy_buffering off;" in block.group(2)
    assert re.fullmatch(block.group(1), "/v2/models/llmpipe_lm_stream/generate_stream")
    assert re.fullmatch(block.group(1), "/v2/models/llmpipe_lm_stream/versions/1/generate_stream")
    assert not re.fullmatch(block.group(1), "/v2/models/llmpipe_lm/generate")


class _SSEUpstream(BaseHTTPRequestHandler):
    """A stand-in for a Triton replica's generate_stream: one event, then a second only once the client
    has read the first (so a proxy that buffers the answer until it ends never delivers the first)."""

    first_read = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"text_output": "a"}\n\n')
        self.wfile.flush()
        self.first_read.wait(5)
        self.wfile.write(b'data: {"text_output": "b"}\n\n')
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow  # starts nginx (about a second)
@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/install.sh installs it)")
def test_nginx_passes_generate_stream_events_as_they_come(tmp_path: Path) -> None:
    from llmpipe.processes import free_ports

    _SSEUpstream.first_read.clear()
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _SSEUpstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    up = upstream.server_address[1]
    listened = [*PRODUCTION_PORTS.values(), DEFAULT_API_PORT]
    ports = dict(zip(listened, free_ports(len(listened)), strict=True))
    conf = re.sub(r"\b(triton|api)-\d+:\d+", f"127.0.0.1:{up}", (ROOT / "nginx.conf").read_text())
    conf = re.sub(r"listen (\d+)", lambda m: f"listen 127.0.0.1:{ports[int(m.group(1))]}", conf)
    conf = conf.replace("pid /tmp/nginx.pid;", f"pid {tmp_path}/nginx.pid;")
    (tmp_path / "logs").mkdir()
    (tmp_path / "nginx.conf").write_text(conf)
    nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        port = ports[PRODUCTION_PORTS["http"]]
        deadline = time.monotonic() + 10
        while True:  # nginx is up once its HTTP port accepts
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert nginx.poll() is None and time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)
        # Triton's generate_stream, and the OpenAI API's streamed completions (their TTFT and ITL)
        for url in (f"http://127.0.0.1:{port}/v2/models/m_stream/generate_stream",
                    f"http://127.0.0.1:{ports[DEFAULT_API_PORT]}/v1/completions"):
            _SSEUpstream.first_read.clear()
            t0 = time.monotonic()
            resp = urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=10)
            first = resp.readline()  # a buffering proxy sends headers and body only when the answer ends
            waited = time.monotonic() - t0
            _SSEUpstream.first_read.set()
            rest = resp.read()
            assert first.startswith(b"data: ") and b'"a"' in first and b'"b"' in rest
            assert waited < 2, f"{url}: the first event came after {waited:.1f} s: nginx buffered the stream"
    finally:
        nginx.terminate()
        nginx.wait(10)
        upstream.shutdown()
