"""Serving readiness before quantization: the deploy target's kernels decide, and the stage says what to change."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from llmpipe.config import PipelineConfig
from llmpipe.quantization.config import QuantizeConfig
from llmpipe.quantization.readiness import (
    ServingReadinessError,
    check_before_quantizing,
    check_checkpoint,
    linear_shapes,
    serving_problems,
)
from llmpipe.quantization.stage import run_quantize
from llmpipe.serving.config import DeployConfig
from llmpipe.serving.stage import run_deploy
from llmpipe.stage import STAGES, StageContext
from llmpipe.store import ArtifactStore

VLLM = DeployConfig(target="gpu", backend="vllm")
PYTHON_CPU = DeployConfig()
PYTHON_GPU = DeployConfig(target="gpu")


def llama_config_dir(path: Path, hidden: int, intermediate: int, quantization: dict | None = None) -> Path:
    """A checkpoint folder with only its config.json: the check reads shapes, never weights."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(path)
    if quantization is not None:  # what llmcompressor writes for W4 groups (compressed-tensors)
        data = json.loads((path / "config.json").read_text())
        data["quantization_config"] = quantization
        (path / "config.json").write_text(json.dumps(data))
    return path


def compressed_tensors_w4(group_size: int) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group_size}}}}


def test_shapes_come_from_the_config_without_weights(tmp_path: Path) -> None:
    shapes = linear_shapes(llama_config_dir(tmp_path, 64, 176), ["lm_head"])
    assert shapes["model.layers.0.mlp.down_proj"] == (176, 64)
    assert shapes["model.layers.1.self_attn.k_proj"] == (64, 32)  # 2 kv heads of 16
    assert not any(n.endswith("lm_head") for n in shapes) and len(shapes) == 14


def test_python_backend_takes_any_shape_and_group() -> None:
    odd = {"mlp.down_proj": (176, 64)}
    for deploy in (PYTHON_CPU, PYTHON_GPU):
        assert serving_problems(odd, "awq_w4", 16, deploy) == []
        assert serving_problems(odd, "int8_dynamic", 128, deploy) == []


def test_vllm_takes_marlin_shapes_and_groups() -> None:
    ok = {"q_proj": (128, 128), "k_proj": (128, 64), "down_proj": (256, 128)}
    for group in (32, 64, 128):
        assert serving_problems(ok, "awq_w4", group, VLLM) == []
    (problem,) = serving_problems(ok, "awq_w4", 16, VLLM)
    assert "quantize.group_size 16" in problem and "set quantize.group_size: 128" in problem
    (problem,) = serving_problems({"down_proj": (176, 64), "up_proj": (64, 176), "q": (128, 128)}, "awq_w4", 128,
                                  VLLM)
    assert "2 of 3 quantized Linear layers" in problem and "down_proj (176 -> 64)" in problem
    assert "up_proj (64 -> 176)" in problem and "train.model.overrides" in problem and "quantize.ignore" in problem
    (problem,) = serving_problems(ok, "int8_dynamic", 128, VLLM)
    assert "quantize.scheme 'int8_dynamic'" in problem and "awq_w4" in problem


def test_before_quantizing_the_tiny_preset_is_refused_for_vllm(tmp_path: Path) -> None:
    tiny = llama_config_dir(tmp_path / "tiny", 64, 176)  # the tiny preset's widths
    check_before_quantizing(tiny, QuantizeConfig(), PYTHON_CPU)  # lowered to 16 later, as before: fine
    with pytest.raises(ServingReadinessError, match=r"quantize: .*backend 'vllm' \(target gpu\).*"
                                                    r"input a multiple of 128, output of 64"):
        check_before_quantizing(tiny, QuantizeConfig(), VLLM)
    wide = llama_config_dir(tmp_path / "wide", 128, 256)
    check_before_quantizing(wide, QuantizeConfig(), VLLM)
    with pytest.raises(ServingReadinessError, match="quantize.group_size 16"):
        check_before_quantizing(wide, QuantizeConfig(group_size=16), VLLM)


def _pipeline(deploy: dict) -> PipelineConfig:
    return PipelineConfig.model_validate({"deploy": deploy})


def test_the_stage_refuses_before_any_work(tmp_path: Path) -> None:
    # only a config: no weights, no tokenizer, no evaluate results. Were the check not first, the
    # stage would fail on the missing evaluate results instead.
    pretrain = tmp_path / "pretrain"
    llama_config_dir(pretrain, 64, 176)
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(spec=STAGES["quantize"], config=QuantizeConfig(device="cpu"),
                       pipeline=_pipeline({"target": "gpu", "backend": "vllm"}), key="k", out=out,
                       inputs={"model": pretrain, "tokenize": tmp_path / "none", "evaluate": tmp_path / "none"},
                       input_keys={}, store=ArtifactStore(tmp_path / "store"), log=logging.getLogger("t"))
    with pytest.raises(ServingReadinessError, match="would not serve"):
        run_quantize(ctx)
    assert list(out.iterdir()) == []
    ctx.pipeline = _pipeline({"target": "cpu"})  # the Python backend: on to the real work (which needs evaluate)
    with pytest.raises(FileNotFoundError, match="evaluate"):
        run_quantize(ctx)


def test_deploy_refuses_a_checkpoint_vllm_cannot_serve(tmp_path: Path) -> None:
    # the quantize key leaves out the deploy section: an artifact made for the Python backend (group
    # lowered to 16) may come from the cache into a vLLM deploy
    art = tmp_path / "quantize"
    llama_config_dir(art / "model", 128, 256, compressed_tensors_w4(16))
    with pytest.raises(ServingReadinessError, match=r"deploy: .*quantize.group_size 16"):
        check_checkpoint(art / "model", VLLM)
    check_checkpoint(art / "model", PYTHON_GPU)
    good = llama_config_dir(tmp_path / "good", 128, 256, compressed_tensors_w4(128))
    check_checkpoint(good, VLLM)
    check_checkpoint(llama_config_dir(tmp_path / "fp", 64, 176), VLLM)  # not quantized: nothing to check
    (good / "llmpipe_quantization.json").write_text(json.dumps({"scheme": "int8_dynamic"}))
    with pytest.raises(ServingReadinessError, match="int8_dynamic"):
        check_checkpoint(good, VLLM)
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(spec=STAGES["deploy"], config=DeployConfig(target="gpu", backend="vllm", verify=False),
                       pipeline=None, key="k", out=out, inputs={"quantize": art}, input_keys={"quantize": "q"},
                       store=ArtifactStore(tmp_path / "store"), log=logging.getLogger("t"))
    with pytest.raises(ServingReadinessError):
        run_deploy(ctx)
    assert list(out.iterdir()) == []
