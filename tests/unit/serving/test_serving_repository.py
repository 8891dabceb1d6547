"""Model repository generation, the version registry and the deploy config (no server)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmpipe.evaluation.model_io import find_checkpoint
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.repository import (
    model_config_summary,
    render_config,
    serving_copy,
    write_model_repository,
)


def test_python_backend_config_has_batching_instances_and_tensors() -> None:
    cfg = DeployConfig(max_batch_size=16, preferred_batch_sizes=[8, 4], max_queue_delay_us=500,
                       instance_count=2, response_cache=True)
    text = render_config(cfg)
    assert 'name: "llmpipe_lm"' in text and 'backend: "python"' in text
    assert "max_batch_size: 16" in text
    assert ("dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 500 "
            "default_queue_policy { max_queue_size: 64 } }") in text
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in text
    assert "response_cache { enable: true }" in text
    inputs = dict(re.findall(r'input \{ name: "(\w+)" data_type: (\w+)', text))
    assert inputs == {"prompt": "TYPE_UINT8", "input_ids": "TYPE_INT64", "max_tokens": "TYPE_INT32",
                      "temperature": "TYPE_FP32", "top_k": "TYPE_INT32", "top_p": "TYPE_FP32", "seed": "TYPE_INT64"}
    assert dict(re.findall(r'output \{ name: "(\w+)" data_type: (\w+)', text)) == {
        "text": "TYPE_UINT8", "output_ids": "TYPE_INT64"}


def test_gpu_target_and_no_dynamic_batching() -> None:
    text = render_config(DeployConfig(target="gpu", dynamic_batching=False))
    assert "KIND_GPU" in text and "dynamic_batching" not in text and "response_cache" not in text


def test_vllm_layout(tmp_path: Path, tiny_checkpoint: Path) -> None:
    cfg = DeployConfig(backend="vllm", target="gpu", model_name="lm")
    vdir = write_model_repository(tiny_checkpoint, tmp_path / "repo", cfg, 3)
    text = (tmp_path / "repo" / "lm" / "config.pbtxt").read_text()
    assert 'backend: "vllm"' in text and "max_batch_size: 0" in text and "decoupled: true" in text
    model_json = json.loads((vdir / "model.json").read_text())
    assert model_json["model"] == "/models/lm/3/checkpoint"
    assert not (vdir / "model.py").exists() and (vdir / "checkpoint" / "config.json").is_file()
    assert model_config_summary(tmp_path / "repo") == {"model": "lm", "version": 3, "backend": "vllm",
                                                       "response_cache": False, "stream_model": None}
    assert not (tmp_path / "repo" / "lm_stream").exists()  # vLLM's model streams on its own


def test_python_layout_copies_checkpoint_and_limits(tmp_path: Path, tiny_checkpoint: Path) -> None:
    cfg = DeployConfig(max_prompt_tokens=40, max_tokens_limit=20, default_max_tokens=5)
    vdir = write_model_repository(tiny_checkpoint, tmp_path / "repo", cfg, 1)
    assert (vdir / "model.py").read_text().startswith('"""Triton Python-backend model')
    assert json.loads((vdir / "llmpipe_serving.json").read_text()) == {
        "max_prompt_tokens": 40, "max_tokens_limit": 20, "default_max_tokens": 5, "max_waiting": 64,
        "seeded_sampling": False, "stream_linger_ms": 8.0,
        "prefill_chunk_tokens": 128}
    src = sorted(p.relative_to(tiny_checkpoint) for p in tiny_checkpoint.rglob("*") if p.is_file())
    dst = sorted(p.relative_to(vdir / "checkpoint") for p in (vdir / "checkpoint").rglob("*") if p.is_file())
    assert src == dst


def test_streaming_model_beside_the_batch_model(tmp_path: Path, tiny_checkpoint: Path) -> None:
    cfg = DeployConfig(model_name="lm", response_cache=True)
    write_model_repository(tiny_checkpoint, tmp_path / "repo", cfg, 2)
    batch = (tmp_path / "repo" / "lm" / "config.pbtxt").read_text()
    stream = (tmp_path / "repo" / "lm_stream" / "config.pbtxt").read_text()
    assert "decoupled" not in batch and "response_cache { enable: true }" in batch
    # decoupled: many responses per request; Triton caches only one-response models
    assert 'name: "lm_stream"' in stream and "model_transaction_policy { decoupled: true }" in stream
    assert "response_cache" not in stream and "dynamic_batching" in stream
    # same tensors, batch sizes, instances; no batching window: streams join the running batch in flight
    assert stream.replace("lm_stream", "lm").replace("model_transaction_policy { decoupled: true }\n", "") == \
        batch.replace("response_cache { enable: true }\n", "").replace(
            f"max_queue_delay_microseconds: {cfg.max_queue_delay_us} ", "max_queue_delay_microseconds: 0 ").replace(
            f"default_queue_policy {{ max_queue_size: {cfg.max_waiting} }} ", "")  # model.py bounds its waiting list
    for name in ("lm", "lm_stream"):
        assert (tmp_path / "repo" / name / "2" / "model.py").read_bytes() == \
            (tmp_path / "repo" / "lm" / "2" / "model.py").read_bytes()
        assert (tmp_path / "repo" / name / "2" / "checkpoint" / "model.safetensors").samefile(
            tiny_checkpoint / "model.safetensors")  # linked once more, no bytes copied
    assert model_config_summary(tmp_path / "repo") == {"model": "lm", "version": 2, "backend": "python",
                                                       "response_cache": True, "stream_model": "lm_stream"}
    write_model_repository(tiny_checkpoint, tmp_path / "plain", DeployConfig(model_name="lm", streaming=False), 1)
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["lm"]


def test_find_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "a" / "model").mkdir(parents=True)
    (tmp_path / "a" / "model" / "config.json").write_text("{}")
    assert find_checkpoint(tmp_path / "a") == tmp_path / "a" / "model"
    (tmp_path / "b").mkdir()
    with pytest.raises(FileNotFoundError, match="no HF checkpoint"):
        find_checkpoint(tmp_path / "b")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"preferred_batch_sizes": [64]}, "preferred_batch_sizes must be in"),
    ({"backend": "vllm"}, "needs target 'gpu'"),
    ({"model_name": "bad name"}, "Triton model name"),
    ({"default_max_tokens": 300}, "default_max_tokens"),
    ({"max_batch_size": 0}, "greater than or equal to 1"),
    ({"unknown": 1}, "Extra inputs"),
    ({"slo_figure": "ttft", "streaming": False}, "measured on the streaming model"),
    ({"load_concurrency": [1, 0]}, "load_concurrency must list levels"),
    ({"load_concurrency": []}, "load_concurrency must list levels"),
])
def test_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DeployConfig(**kwargs)


def test_run_settings_stay_out_of_the_key() -> None:
    key = DeployConfig().key_dict()
    assert "slo_p99_ms" not in key and "load_clients" not in key and "verify" not in key
    assert "load_concurrency" not in key and "slo_figure" not in key and key["streaming"] is True
    assert key["max_batch_size"] == 32


def test_serving_copy_shares_the_files_and_keeps_new_ones_out_of_the_artifact(tmp_path: Path,
                                                                              tiny_checkpoint: Path) -> None:
    art = tmp_path / "store" / "deploy" / "k1"
    repo = art / "model_repository"
    vdir = write_model_repository(tiny_checkpoint, repo, DeployConfig(model_name="lm"), 1)
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    copy = serving_copy(repo)
    assert copy.parent == art.parent and copy.name.startswith(".tmp-serve-")  # beside the artifact: gc's
    assert sorted(p.relative_to(copy) for p in copy.rglob("*")) == before
    weights = vdir / "checkpoint" / "model.safetensors"
    assert (copy / "lm" / "1" / "checkpoint" / "model.safetensors").samefile(weights)  # linked, not copied
    (copy / "lm" / "1" / "__pycache__").mkdir()  # what the Python backend writes next to model.py
    (copy / "lm" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"x")
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before
