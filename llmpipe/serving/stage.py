"""The ``deploy`` stage: quantized checkpoint -> Triton model repository, checked on a real local server.

Output artifact::

    model_repository/<model>/...   # see llmpipe/serving/repository.py
    deploy.json                    # model, version, backend, ports the production manifests use
    triton.env                     # MODEL_NAME / MODEL_VERSION for deployments/triton/docker-compose.yml

The smoke- and load-test figures (latencies, throughput, the batch histogram) are measurements of
one run: they go to the manifest's stats and the ``deploy-latency`` report, not into the files, and
the server runs on a copy of the repository (see ``server.serve``), so it writes nothing here either.
"""

from __future__ import annotations

import json
from typing import Any

from llmpipe.serving.config import DeployConfig
from llmpipe.serving.layout import DEPLOY
from llmpipe.stage import StageContext, stage

# The repository writer, server and load test import torch and the Triton client: they are imported
# inside the functions below, so registering the stage (every ``llmpipe`` command) stays cheap.

# The ports every production replica listens on (deployments/triton/ relies on them).
PRODUCTION_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}



@stage("deploy", version="3", inputs=("quantize",), config_field="deploy", flow="release",
       requires=("torch", "transformers", "tritonclient"), extra="serve")
def run_deploy(ctx: StageContext) -> dict[str, Any]:
    """Write a Triton model repository for the quantized model; smoke- and load-test it locally."""
    from llmpipe.evaluation.model_io import find_checkpoint
    from llmpipe.serving.repository import write_model_repository

    cfg: DeployConfig = ctx.config or DeployConfig()
    ckpt = find_checkpoint(ctx.inputs["quantize"])
    # the version is the config's, never the store's history: the same key holds the same bytes anywhere
    version = cfg.model_version
    write_model_repository(ckpt, ctx.out / DEPLOY.repository, cfg, version)
    info = {"model": cfg.model_name, "version": version, "backend": cfg.backend, "target": cfg.target,
            "quantize_key": ctx.input_keys.get("quantize"), "ports": PRODUCTION_PORTS,
            "repository": DEPLOY.repository}
    (ctx.out / DEPLOY.info).write_text(json.dumps(info, indent=2) + "\n")
    (ctx.out / DEPLOY.env).write_text(f"MODEL_NAME={cfg.model_name}\nMODEL_VERSION={version}\n")
    ctx.log.info("deploy: %s v%d (%s, %s) from %s", cfg.model_name, version, cfg.backend, cfg.target, ckpt)
    stats: dict[str, Any] = {"model": cfg.model_name, "version": version, "backend": cfg.backend}
    reason = _skip_reason(cfg)
    if reason:
        ctx.log.warning("deploy: local server check skipped: %s", reason)
        ctx.report_markdown("deploy-check", "Triton local check", f"Skipped: {reason}")
        return {**stats, "verified": False, "verify_skipped": reason}
    return {**stats, **verify(ctx, cfg)}


def _skip_reason(cfg: DeployConfig) -> str | None:
    from llmpipe.serving import server

    if not cfg.verify:
        return "deploy.verify is false"
    if cfg.backend != "python" or cfg.target != "cpu":
        return f"the local server runs the Python backend on CPU only (backend={cfg.backend}, target={cfg.target})"
    if not server.available():
        return "no local Triton server (run scripts/install.sh: pip install --no-deps nvidia-pytriton)"
    return None


def verify(ctx: StageContext, cfg: DeployConfig) -> dict[str, Any]:
    """Start the generated repository on a local server: smoke test (HTTP, gRPC), then the load test."""
    from llmpipe.serving import loadtest, server
    ctx.progress("start tritonserver", 0, 3)
    with server.serve(ctx.out / DEPLOY.repository, startup_timeout_s=cfg.startup_timeout_s) as srv:
        smoke = [loadtest.smoke_test(srv.http_url, cfg.model_name, "http"),
                 loadtest.smoke_test(srv.grpc_url, cfg.model_name, "grpc")]
        ctx.progress("load test", 1, 3)
        url = srv.grpc_url if cfg.load_protocol == "grpc" else srv.http_url
        result = loadtest.load_test(
            url, cfg.model_name, protocol=cfg.load_protocol, clients=cfg.load_clients,
            requests=cfg.load_requests, max_seconds=cfg.load_max_seconds, max_tokens=cfg.load_max_tokens,
            slo_p99_ms=cfg.slo_p99_ms)
    ctx.progress("done", 3, 3)
    stats = {"verified": True, "smoke": smoke, **{k: result[k] for k in LOAD_TEST_STATS},
             "load_seconds": result["seconds"], **{f"smoke_{s['protocol']}_ms": s["latency_ms"] for s in smoke}}
    ctx.report_stats("deploy-latency", "Triton load test",
                     [*LOAD_TEST_STATS, "load_seconds", *(f"smoke_{s['protocol']}_ms" for s in smoke)])
    return stats


# The load test's figures that the manifest's stats keep (and the deploy-latency report shows).
LOAD_TEST_STATS = ("protocol", "clients", "requests", "errors", "p50_ms", "p95_ms", "p99_ms", "mean_ms",
                   "slo_p99_ms", "slo_ok", "throughput_rps", "mean_batch_size", "batch_histogram")
