"""The fast path's small parts that run without a GPU: the FLOPs count against a hand count of the
real model's matmuls, the peak-FLOPs lookup and its override, MFU per step and its mean, and the
settings that refuse what cannot run (compile with pipeline stages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmpipe.config import ConfigError, load_config
from llmpipe.training.config import TrainConfig
from llmpipe.training.model import PEAK_FLOPS, device_peak_flops, flops_per_token, llama_config
from llmpipe.training.trainer import Trainer


@pytest.mark.parametrize(("preset", "overrides"), [("tiny", {}), ("tiny", {"num_key_value_heads": 2}),
                                                   ("1b", {"num_hidden_layers": 1})])
def test_flops_per_token_is_six_times_every_matmul_weight_plus_attention(preset: str, overrides: dict) -> None:
    """A hand count from the built model: every ``nn.Linear`` weight (q, k, v, o, gate, up, down in
    each layer and the LM head; not the embedding lookup or the norms) does 2 FLOPs per token forward
    and 4 backward; attention's q·k and p·v add 2·2·s·h forward per layer, x3 with backward."""
    from transformers import AutoModelForCausalLM

    conf = llama_config(preset, 1000, overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    seq = 256
    attention = 3 * 2 * 2 * seq * conf.hidden_size * conf.num_hidden_layers
    assert flops_per_token(conf, seq) == 6 * matmul + attention


def test_peak_flops_by_exact_name_with_an_override() -> None:
    assert device_peak_flops(torch.device("cpu")) is None
    assert device_peak_flops(torch.device("cpu"), 400.0) == 400e12
    assert PEAK_FLOPS["NVIDIA H100 PCIe"] < PEAK_FLOPS["NVIDIA H100 80GB HBM3"]  # PCIe is not SXM
    assert PEAK_FLOPS["NVIDIA H200 NVL"] < PEAK_FLOPS["NVIDIA H200"]
    with pytest.raises(ConfigError, match=r"train\.launch\.peak_tflops: Input should be greater than 0"):
        load_config(data={"train": {"launch": {"peak_tflops": 0}}})


def test_compile_with_pipeline_stages_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"compile: true with parallel\.pipeline > 1: the pipeline stages run "
                                          r"uncompiled.*set compile: false"):
        load_config(data={"train": {"compile": True, "parallel": {"pipeline": 2}}})


def test_deterministic_is_a_run_setting_off_by_default() -> None:
    assert TrainConfig().launch.deterministic is False
    assert TrainConfig(launch={"deterministic": True}).key_dict() == TrainConfig().key_dict()


def test_mfu_per_step_from_the_peak_override(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """With ``launch.peak_tflops`` the CPU run reports MFU too: each step's achieved FLOP/s over it."""
    torch.set_num_threads(1)
    cfg = TrainConfig(**tiny_train(max_steps=2, launch={"nproc_per_node": 1, "peak_tflops": 0.5},
                                   checkpoint={"every": 0}))
    Trainer(worker_spec(cfg, packed, tmp_path)).run()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] == pytest.approx(r["flops_per_s"] / 0.5e12) for r in recs)


def test_the_stage_reports_the_mean_mfu_not_the_last() -> None:
    from llmpipe.training.stage import _mean_of

    recs = [{"mfu": 0.2}, {"mfu": 0.4}, {"mfu": None}, {}]
    assert _mean_of(recs, "mfu") == pytest.approx(0.3) and _mean_of([{}], "mfu") is None
