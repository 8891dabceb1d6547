"""The ``deploy`` stage: quantized checkpoint -> Triton model repository, checked on a real local server.

Output artifact::

    model_repository/<model>/...   # see llmpipe/serving/repository.py
    deploy.json                    # model, version, backend, ports the production manifests use
    triton.env                     # MODEL_NAME / STREAM_MODEL_NAME / MODEL_VERSION for deployments/triton/

The repository holds the batch model and (``deploy.streaming``) its streaming model. The check
smoke-tests both over HTTP and gRPC, and the OpenAI-compatible API in front of them (plain and streamed), load-tests the batch model (latency, throughput, the server's
batch histogram) and the streaming model at each ``deploy.load_concurrency`` level (TTFT, ITL, e2e
p50/p90/p99, output tokens/s, requests/s), and fails the release when the p99 of
``deploy.slo_figure`` is over ``deploy.slo_p99_ms`` at any level. With ``deploy.engine: vllm`` the check
serves the repository's checkpoint with vLLM's own OpenAI server instead (its CPU build, in the
environment ``scripts/install.sh --test`` builds; skipped, saying so, where it is absent) and runs the
same OpenAI smoke test and the streaming load test through that API. These figures are measurements of
one run: they go to the manifest's stats and the ``deploy-latency`` / ``deploy-streaming`` reports,
not into the files, and the server runs on a copy of the repository (see ``server.serve``), so it
writes nothing here either.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from llmpipe.serving.config import DeployConfig
from llmpipe.serving.layout import DEPLOY
from llmpipe.stage import StageContext, stage

# The repository writer, server and load test import torch and the Triton client: they are imported
# inside the functions below, so registering the stage (every ``llmpipe`` command) stays cheap.

# The ports every production replica listens on (deployments/triton/ relies on them).
PRODUCTION_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


@stage("deploy", version="10", inputs=("quantize",), config_field="deploy", flow="release",
       requires=("torch", "transformers", "tritonclient", "fastapi", "uvicorn"), extra="serve")
def run_deploy(ctx: StageContext) -> dict[str, Any]:
    """Write a Triton model repository for the quantized model; smoke- and load-test it locally."""
    from llmpipe.evaluation.model_io import find_checkpoint
    from llmpipe.quantization.readiness import check_checkpoint
    from llmpipe.serving.repository import write_model_repository

    cfg: DeployConfig = ctx.config or DeployConfig()
    ckpt = find_checkpoint(ctx.inputs["quantize"])
    check_checkpoint(ckpt, cfg)  # the quantize key leaves deploy out: a cached artifact may be for another backend
    # the version is the config's, never the store's history: the same key holds the same bytes anywhere
    version = cfg.model_version
    write_model_repository(ckpt, ctx.out / DEPLOY.repository, cfg, version)
    stream_model = cfg.stream_model_name if _streams(cfg) else None
    info = {"model": cfg.model_name, "stream_model": stream_model, "version": version, "backend": cfg.backend,
            "engine": cfg.engine, "target": cfg.target, "quantize_key": ctx.input_keys.get("quantize"), "ports": PRODUCTION_PORTS,
            "repository": DEPLOY.repository}
    (ctx.out / DEPLOY.info).write_text(json.dumps(info, indent=2) + "\n")
    # compose loads STREAM_MODEL_NAME too: the batch model again where there is no streaming model
    (ctx.out / DEPLOY.env).write_text(f"MODEL_NAME={cfg.model_name}\nSTREAM_MODEL_NAME={stream_model or cfg.model_name}"
                                      f"\nMODEL_VERSION={version}\n")
    ctx.log.info("deploy: %s v%d (%s, %s) from %s", cfg.model_name, version, cfg.backend, cfg.target, ckpt)
    stats: dict[str, Any] = {"model": cfg.model_name, "version": version, "backend": cfg.backend, "engine": cfg.engine}
    reason = _skip_reason(cfg)
    if reason:
        ctx.log.warning("deploy: local server check skipped: %s", reason)
        ctx.report_markdown("deploy-check", "Triton local check", f"Skipped: {reason}")
        return {**stats, "verified": False, "verify_skipped": reason}
    return {**stats, **(verify_vllm(ctx, cfg) if cfg.engine == "vllm" else verify(ctx, cfg))}


def _skip_reason(cfg: DeployConfig) -> str | None:
    from llmpipe.serving import server

    if not cfg.verify:
        return "deploy.verify is false"
    if cfg.backend != "python" or cfg.target != "cpu":
        return f"the local server runs the Python backend on CPU only (backend={cfg.backend}, target={cfg.target})"
    if cfg.engine == "vllm":
        from llmpipe.serving.vllm_engine import VENV, vllm_python

        return None if vllm_python() else (f"engine vllm: vLLM is not installed (no {VENV}/bin/python; "
                                           "scripts/install.sh --test builds it, LLMPIPE_VLLM_PYTHON names another)")
    if not server.available():
        return "no local Triton server (run scripts/install.sh: pip install --no-deps nvidia-pytriton)"
    return None


def _streams(cfg: DeployConfig) -> bool:
    return cfg.streaming and cfg.backend == "python"


def verify(ctx: StageContext, cfg: DeployConfig) -> dict[str, Any]:
    """Start the generated repository on a local server: smoke tests (HTTP, gRPC; batch and streaming
    model), the batch model's load test, then the streaming load test per concurrency level."""
    from llmpipe.serving import loadtest, server
    from llmpipe.serving.openai_api import api_config, serve_api

    streaming = _streams(cfg)
    ctx.progress("start tritonserver", 0, 4)
    with server.serve(ctx.out / DEPLOY.repository, startup_timeout_s=cfg.startup_timeout_s) as srv, \
            serve_api(api_config(srv.repo, srv.grpc_url)) as api:
        smoke = [loadtest.smoke_test(srv.http_url, cfg.model_name, "http"),
                 loadtest.smoke_test(srv.grpc_url, cfg.model_name, "grpc")]
        if streaming:
            smoke += [loadtest.smoke_test(srv.http_url, cfg.stream_model_name, "http", stream=True),
                      loadtest.smoke_test(srv.grpc_url, cfg.stream_model_name, "grpc", stream=True)]
        smoke += loadtest.api_smoke_test(api.url, cfg.model_name)  # what OpenAI clients see
        ctx.progress("load test", 1, 4)
        url = srv.grpc_url if cfg.load_protocol == "grpc" else srv.http_url
        result = loadtest.load_test(
            url, cfg.model_name, protocol=cfg.load_protocol, clients=cfg.load_clients,
            requests=cfg.load_requests, max_seconds=cfg.load_max_seconds, max_tokens=cfg.load_max_tokens,
            slo_p99_ms=None if streaming else cfg.slo_p99_ms)
        stream = None
        if streaming:
            ctx.progress("streaming load test", 2, 4)
            stream = loadtest.stream_load_test(
                url, cfg.stream_model_name, protocol=cfg.load_protocol, concurrency=cfg.load_concurrency,
                requests=cfg.load_requests, max_seconds=cfg.load_max_seconds, max_tokens=cfg.load_max_tokens,
                slo_figure=cfg.slo_figure, slo_p99_ms=cfg.slo_p99_ms)
    ctx.progress("done", 4, 4)
    stats = {"verified": True, "smoke": smoke, **{k: result[k] for k in LOAD_TEST_STATS},
             "load_seconds": result["seconds"], **{_smoke_key(s): s["latency_ms"] for s in smoke}}
    fields = [*LOAD_TEST_STATS, "load_seconds", *(_smoke_key(s) for s in smoke)]
    if stream is not None:
        stats.update(_stream_stats(ctx, cfg, stream))
        fields += ["slo_figure", "slo_worst_p99_ms"]
    ctx.report_stats("deploy-latency", "Triton load test", fields)
    return stats


def verify_vllm(ctx: StageContext, cfg: DeployConfig) -> dict[str, Any]:
    """``deploy.engine: vllm``: vLLM's OpenAI server on the repository's checkpoint; the OpenAI smoke test
    and the streaming load test per concurrency level through it."""
    from llmpipe.serving import loadtest
    from llmpipe.serving.server import deployed_checkpoint
    from llmpipe.serving.vllm_engine import vllm_server

    name, checkpoint = deployed_checkpoint(ctx.out / DEPLOY.repository)
    ctx.progress("start vLLM", 0, 3)
    with tempfile.TemporaryDirectory(prefix="llmpipe-vllm-") as tmp, \
            vllm_server(checkpoint, Path(tmp) / "vllm.log", model_name=name, threads=_threads(),
                        startup_timeout=max(cfg.startup_timeout_s, VLLM_STARTUP_S),
                        enforce_eager=cfg.vllm_enforce_eager) as api:
        smoke = loadtest.api_smoke_test(api.base_url, name)
        ctx.progress("streaming load test", 1, 3)
        stream = loadtest.api_stream_load_test(
            api.base_url, name, concurrency=cfg.load_concurrency, requests=cfg.load_requests,
            max_seconds=cfg.load_max_seconds, max_tokens=cfg.load_max_tokens, slo_figure=cfg.slo_figure,
            slo_p99_ms=cfg.slo_p99_ms)
    ctx.progress("done", 3, 3)
    stats = {"verified": True, "smoke": smoke, **{_smoke_key(s): s["latency_ms"] for s in smoke},
             **_stream_stats(ctx, cfg, stream), "stream_model": name}
    ctx.report_stats("deploy-latency", "vLLM check (OpenAI API)",
                     [*(_smoke_key(s) for s in smoke), "slo_figure", "slo_p99_ms", "slo_ok", "slo_worst_p99_ms"])
    return stats


VLLM_STARTUP_S = 600.0  # vLLM's CPU build answered 55 s after start on an idle 2-core machine


def _threads() -> int:
    """vLLM's OpenMP threads: half the cores (the load test's clients need the rest)."""
    return max(1, (os.cpu_count() or 2) // 2)


def _stream_stats(ctx: StageContext, cfg: DeployConfig, stream: dict[str, Any]) -> dict[str, Any]:
    """The streaming load test's stats (they replace the batch test's slo_*), and its two reports:
    the per-level table and the latency-against-concurrency chart, both read from the stats."""
    from llmpipe.serving import loadtest

    ctx.report_from_stats("table", "deploy-streaming", "Streaming load test: TTFT, ITL, e2e per concurrency",
                          "stream_levels")
    ctx.report_from_stats("markdown", "deploy-streaming-chart", "Latency against concurrency", "stream_chart")
    return {"slo_figure": stream["slo_figure"], "slo_p99_ms": cfg.slo_p99_ms, "slo_ok": stream["slo_ok"],
            "slo_worst_p99_ms": stream["worst_p99_ms"], "stream_model": cfg.stream_model_name,
            "stream_levels": [{k: v for k, v in lv.items() if k != "error_samples"} for lv in stream["levels"]],
            "stream_chart": loadtest.levels_markdown(stream)}


def _smoke_key(smoke: dict[str, Any]) -> str:
    return f"smoke_{'stream_' if smoke.get('stream') else ''}{smoke['protocol']}_ms"


# The batch load test's figures that the manifest's stats keep (and the deploy-latency report shows);
# with a streaming model, slo_* are the streaming load test's SLO check.
LOAD_TEST_STATS = ("protocol", "clients", "requests", "errors", "p50_ms", "p95_ms", "p99_ms", "mean_ms",
                   "slo_p99_ms", "slo_ok", "throughput_rps", "mean_batch_size", "batch_histogram")
