"""The deploy stage end to end: repository, the configured version, and (slow) the local server check."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from llmpipe.serving import server as srv
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.stage import run_deploy
from llmpipe.serving.vllm_engine import vllm_python
from llmpipe.stage import STAGES, StageContext, stats_rows
from llmpipe.store import ArtifactStore
from tests.conftest import ROOT
from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint


def _ctx(tmp: Path, ckpt_parent: Path, cfg: DeployConfig, key: str) -> StageContext:
    store = ArtifactStore(tmp / "store")
    out = tmp / f"out-{key}"
    out.mkdir()
    return StageContext(spec=STAGES["deploy"], config=cfg, pipeline=None, key=key, out=out,
                        inputs={"quantize": ckpt_parent}, input_keys={"quantize": "q-" + key}, store=store,
                        log=logging.getLogger("test.deploy"))


def test_stage_writes_repository_with_the_configured_version(tmp_path: Path, tiny_checkpoint: Path) -> None:
    cfg = DeployConfig(verify=False, model_name="lm")
    stats = run_deploy(_ctx(tmp_path, tiny_checkpoint, cfg, "k1"))
    assert stats["version"] == 1 and stats["verified"] is False and "verify is false" in stats["verify_skipped"]
    out = tmp_path / "out-k1"
    assert (out / "model_repository" / "lm" / "config.pbtxt").is_file()
    assert (out / "model_repository" / "lm" / "1" / "checkpoint" / "model.safetensors").is_file()
    info = json.loads((out / "deploy.json").read_text())
    assert info["model"] == "lm" and info["version"] == 1 and info["quantize_key"] == "q-k1"
    assert (out / "triton.env").read_text() == "MODEL_NAME=lm\nSTREAM_MODEL_NAME=lm_stream\nMODEL_VERSION=1\n"
    assert info["stream_model"] == "lm_stream" and (out / "model_repository" / "lm_stream" / "config.pbtxt").is_file()
    # another deploy into the same store: still the configured version (the store's history is no input)
    assert run_deploy(_ctx(tmp_path, tiny_checkpoint, cfg, "k2"))["version"] == 1
    v2 = DeployConfig(verify=False, model_name="lm", model_version=2)
    assert run_deploy(_ctx(tmp_path, tiny_checkpoint, v2, "k3"))["version"] == 2
    assert (tmp_path / "out-k3" / "model_repository" / "lm" / "2" / "model.py").is_file()
    assert (tmp_path / "out-k3" / "triton.env").read_text() == \
        "MODEL_NAME=lm\nSTREAM_MODEL_NAME=lm_stream\nMODEL_VERSION=2\n"


@pytest.mark.slow
@pytest.mark.skipif(not srv.available(), reason="no Triton binary: run scripts/install.sh")
def test_stage_verifies_on_a_real_server(tmp_path: Path, tiny_checkpoint: Path) -> None:
    cfg = DeployConfig(load_clients=4, load_requests=16, load_max_tokens=4, load_concurrency=[1, 4],
                       slo_figure="ttft", slo_p99_ms=60_000, vllm_enforce_eager=True)  # start without compiling
    ctx = _ctx(tmp_path, tiny_checkpoint, cfg, "k1")
    stats = run_deploy(ctx)
    assert stats["verified"] and stats["requests"] == 16 and stats["p99_ms"] > 0
    assert [(s["protocol"], s["stream"]) for s in stats["smoke"]] == [
        ("http", False), ("grpc", False), ("http", True), ("grpc", True), ("openai", False), ("openai", True)]
    assert stats["errors"] == 0 and stats["smoke_http_ms"] > 0 and stats["smoke_stream_grpc_ms"] > 0
    assert stats["smoke_openai_ms"] > 0 and stats["smoke_stream_openai_ms"] > 0  # the OpenAI API, plain and streamed
    # the streaming load test per level, and the SLO on the figure the config names
    levels = stats["stream_levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4] and all(lv["requests"] == 16 for lv in levels)
    for lv in levels:
        assert 0 < lv["ttft_p50_ms"] <= lv["ttft_p90_ms"] <= lv["ttft_p99_ms"] <= lv["e2e_p99_ms"]
        assert lv["itl_p50_ms"] > 0 and lv["output_tokens_per_s"] > 0 and lv["requests_per_s"] > 0
    assert stats["slo_figure"] == "ttft" and stats["slo_ok"] and stats["slo_p99_ms"] == 60_000
    assert stats["slo_worst_p99_ms"] == max(lv["ttft_p99_ms"] for lv in levels)
    assert "| 4 |" in stats["stream_chart"]
    # measurements live in the stats only, and the server ran on a copy: nothing new in the artifact
    out = tmp_path / "out-k1"
    assert not (out / "latency.json").exists() and not list(out.rglob("__pycache__"))
    assert not list(out.parent.glob(".tmp-serve-*")) and not list((tmp_path / "store").rglob(".tmp-serve-*"))
    table = next(r for r in ctx.reports if r.key == "deploy-latency")
    assert table.kind == "stats" and set(table.payload) >= {"p50_ms", "p95_ms", "p99_ms", "throughput_rps"}
    rows = {row["metric"]: row["value"] for row in stats_rows(stats, table.payload)}
    assert rows["p99_ms"] == stats["p99_ms"] and json.loads(rows["batch_histogram"]) == stats["batch_histogram"]
    reports = {r.key: r for r in ctx.reports}
    assert reports["deploy-streaming"].kind == "stats-table" and reports["deploy-streaming"].payload == "stream_levels"
    assert reports["deploy-streaming-chart"].kind == "stats-markdown"
    json.dumps(stats)  # the manifest keeps it as JSON


def test_engine_vllm_without_vllm_is_skipped_saying_so(tmp_path: Path, tiny_checkpoint: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMPIPE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    stats = run_deploy(_ctx(tmp_path, tiny_checkpoint, DeployConfig(engine="vllm"), "k1"))
    assert stats["engine"] == "vllm" and stats["verified"] is False and "vLLM is not installed" in stats["verify_skipped"]
    assert json.loads((tmp_path / "out-k1" / "deploy.json").read_text())["engine"] == "vllm"
    with pytest.raises(ValueError, match="engine 'vllm' serves the repository's Hugging Face checkpoint"):
        DeployConfig(engine="vllm", backend="vllm", target="gpu")


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None and vllm_python(base=ROOT) is None,
                    reason="vLLM (CPU build) is not installed: scripts/install.sh --test builds .venv-vllm; or set "
                    "LLMPIPE_VLLM_PYTHON")
def test_stage_verifies_with_the_vllm_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``deploy.engine: vllm``: the same repository, served by vLLM's OpenAI server; the smoke test and the
    streaming load test run through the OpenAI API against it."""
    monkeypatch.setenv("LLMPIPE_VLLM_PYTHON", str(vllm_python() or vllm_python(base=ROOT)))
    # 4 heads of 32: vLLM's CPU attention refuses the serving fixture's head size of 16
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", hidden=128)
    cfg = DeployConfig(engine="vllm", load_requests=8, load_max_tokens=4, load_concurrency=[1, 4],
                       slo_figure="ttft", slo_p99_ms=60_000)
    ctx = _ctx(tmp_path, ckpt, cfg, "k1")
    stats = run_deploy(ctx)
    assert stats["verified"] and stats["engine"] == "vllm" and stats["stream_model"] == "llmpipe_lm"
    assert [(s["protocol"], s["stream"]) for s in stats["smoke"]] == [("openai", False), ("openai", True)]
    levels = stats["stream_levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4] and all(lv["requests"] == 8 for lv in levels)
    assert all(lv["errors"] == 0 and 0 < lv["ttft_p50_ms"] <= lv["ttft_p99_ms"] for lv in levels)
    assert all(lv["output_tokens_per_s"] > 0 for lv in levels) and stats["slo_ok"]
    assert {r.key for r in ctx.reports} >= {"deploy-latency", "deploy-streaming", "deploy-streaming-chart"}
    json.dumps(stats)
