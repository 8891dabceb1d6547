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


def test_the_gpu_benchmark_refuses_on_cpu_with_one_line() -> None:
    """``benchmarks/gpu/run.sh`` measures only on a GPU; here (no CUDA) it says so in one line, exit 2."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would measure")
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(repo)}
    r = subprocess.run(["bash", str(repo / "benchmarks/gpu/run.sh")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["benchmarks/gpu/run.sh: no CUDA GPU here (torch.cuda.is_available() is "
                                     "False); nothing measured"]


@pytest.mark.slow
def test_fsdp2_runs_on_one_process(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """A preset that names FSDP2 runs as shipped on one GPU (``benchmarks/gpu/run.sh``): a one-rank
    process group and mesh; the losses are those of DDP on one process."""
    from llmpipe.training.launch import launch

    losses = {}
    for strategy in ("fsdp2", "ddp"):
        cfg = TrainConfig(**tiny_train(strategy=strategy, max_steps=3, checkpoint={"every": 0},
                                       launch={"nproc_per_node": 1}))
        res = launch(cfg.launch, worker_spec(cfg, packed, tmp_path / strategy), tmp_path / strategy)
        losses[strategy] = [m["loss"] for m in res.metrics]
    assert max(abs(a - b) for a, b in zip(losses["fsdp2"], losses["ddp"], strict=True)) <= 1e-5, losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_loss_equals_the_plain_one_and_keeps_no_fp32_vocabulary(dtype: torch.dtype) -> None:
    """Loss and gradient of the chunked cross-entropy against ``token_loss`` to 1e-5 (padding targets
    included, a last chunk shorter than the others); autograd keeps the logits themselves and no fp32
    tensor of the whole vocabulary for every token."""
    from llmpipe.training.engines import chunked_token_loss, token_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 50, 300).to(dtype)
    targets = torch.randint(0, 300, (2, 50))
    targets[0, :7] = -100
    grads = []
    for fn in (lambda x: token_loss(x, targets), lambda x: chunked_token_loss(x, targets, 16)):
        x = logits.clone().requires_grad_(True)
        loss = fn(x)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    (plain, g_plain), (chunked, g_chunked) = grads
    assert abs(float(plain) - float(chunked)) <= 1e-5
    assert torch.allclose(g_plain.float(), g_chunked.float(), atol=1e-5)
    kept: list[torch.Tensor] = []
    x = logits.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        chunked_token_loss(x, targets, 16)
    big_fp32 = [t for t in kept if t.dtype == torch.float32 and t.numel() >= 100 * 300]
    assert dtype == torch.float32 or not big_fp32, [t.shape for t in big_fp32]


def test_the_compiled_loss_equals_the_plain_one_and_saves_no_fp32_vocabulary() -> None:
    """The loss a compiled model uses on a GPU (``compiled_token_loss``: Inductor fuses the upcast),
    run through Inductor's CPU backend here: loss and gradient equal ``token_loss``'s to 1e-5 for bf16
    logits, and what it saves for backward holds no fp32 tensor of the whole vocabulary per token."""
    from llmpipe.training.engines import compiled_token_loss, token_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 50, 300).to(torch.bfloat16)
    targets = torch.randint(0, 300, (2, 50))
    targets[0, :7] = -100
    out, kept = [], []
    for fn in (token_loss, compiled_token_loss):
        x = logits.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            loss = fn(x, targets)
        if fn is token_loss:
            kept.clear()
        loss.backward()
        out.append((loss.detach(), x.grad))
    (plain, g_plain), (fused, g_fused) = out
    assert abs(float(plain) - float(fused)) <= 1e-5
    assert torch.allclose(g_plain.float(), g_fused.float(), atol=1e-5)
    assert kept and not [t for t in kept if t.dtype == torch.float32 and t.numel() >= 100 * 300]
