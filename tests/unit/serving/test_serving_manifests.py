"""Production manifests in deployments/triton/: nginx accepts its conf, compose matches the stage's output."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from llmpipe.serving.config import DeployConfig
from llmpipe.serving.stage import PRODUCTION_PORTS, run_deploy
from llmpipe.stage import STAGES, StageContext
from llmpipe.store import ArtifactStore

ROOT = Path(__file__).resolve().parents[3] / "deployments" / "triton"


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx not installed (scripts/install.sh installs it)")
def test_nginx_accepts_the_conf(tmp_path: Path) -> None:
    # The upstream hosts only resolve inside the compose network: point them at loopback for the check.
    conf = re.sub(r"\btriton-\d+\b", "127.0.0.1", (ROOT / "nginx.conf").read_text())
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
    assert published == set(info["ports"].values())
    assert services["redis"]["profiles"] == ["cache"]
