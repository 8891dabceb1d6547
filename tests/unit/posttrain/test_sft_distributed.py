"""SFT under torchrun (``sft.launch.nproc_per_node: 2``, gloo on the CPU) learns the weights one process learns.

Each rank computes its share of a step's pairs and the loss is normalized by the response tokens of
the whole global batch, summed over ranks, so the data-parallel step is the single-process step;
the tiny random Llama of ``tests/fixtures/tiny_checkpoint.py`` trains a few steps both ways in fp32.
The workers are started by pretraining's ``launch``: none outlives the call.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import torch

from llmpipe.posttrain.config import SftConfig
from llmpipe.posttrain.data import Pair
from tests.fixtures.tiny_checkpoint import make_tiny_checkpoint

PAIRS = [Pair((("user", p),), r) for p, r in [
    ("Say this word twice: river", "river river"), ("What is 3 plus 4?", "7"),
    ("Écris ce mot en majuscules : pomme", "POMME"), ("Name a colour.", "blue"),
    ("Count to three.", "one two three"), ("Wie heißt die Hauptstadt von Frankreich?", "Paris"),
    ("Reverse the letters: abc", "cba"), ("Is ice cold?", "yes, ice is cold")]]


def _cfg(strategy: str, nproc: int) -> SftConfig:
    return SftConfig(max_steps=3, batch_size=5, lr=1e-3, max_length=64, packing=True, strategy=strategy,
                     launch={"nproc_per_node": nproc, "device": "cpu", "threads_per_process": 1})


def _single(src: Path, cfg: SftConfig) -> tuple[dict[str, torch.Tensor], list[float]]:
    from llmpipe.posttrain import sft
    from llmpipe.posttrain.stage import load_model

    torch.set_num_threads(1)
    model, tok = load_model(src, "test")
    log = sft.train(model, tok, PAIRS, steps=cfg.max_steps, batch_size=cfg.batch_size, lr=cfg.lr,
                    weight_decay=cfg.weight_decay, max_length=cfg.max_length, seed=cfg.seed, packing=cfg.packing)
    return model.state_dict(), [r["loss"] for r in log]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_gloo_ranks_learn_the_single_process_weights(tmp_path: Path, strategy: str) -> None:
    from transformers import AutoModelForCausalLM

    from llmpipe.posttrain.sft_launch import launch_sft

    src = make_tiny_checkpoint(tmp_path / "ckpt")
    cfg = _cfg(strategy, 2)
    want, losses = _single(src, cfg)
    seen: dict[int, psutil.Process] = {}
    # what this process ran before the launch (the suite's session servers) is not the launch's
    before = {c.pid for c in psutil.Process(os.getpid()).children(recursive=True)}

    def note(step: int, loss: float) -> None:  # while the workers run: the stage's process tree, less
        # llmpipe.processes' watchdog (it lives as long as this process, to end the tree if it dies)
        seen.update({c.pid: c for c in psutil.Process(os.getpid()).children(recursive=True)
                     if c.pid not in before and "--guardian" not in c.cmdline()})

    res = launch_sft(cfg, src, PAIRS, tmp_path / "out", tmp_path / "run", on_step=note)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert [r["step"] for r in res.metrics] == [1, 2, 3]
    assert [r["loss"] for r in res.summary["records"]] == pytest.approx(losses, rel=1e-5)
    start = make_ref(src)
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert moved > 1e-3  # the steps changed the weights, so equal weights say something
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=2e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert len(seen) >= 3  # torchrun's agent and its two workers
    alive = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes outlived the launch: {alive}"


def make_ref(src: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()


def test_one_process_is_the_default_and_launch_stays_out_of_the_key() -> None:
    cfg = SftConfig()
    assert cfg.launch.nproc_per_node == 1 and cfg.strategy == "ddp"
    assert "launch" not in cfg.key_dict() and "strategy" not in cfg.key_dict()
    assert _cfg("fsdp2", 2).key_dict() == _cfg("ddp", 1).key_dict()


def test_a_global_batch_smaller_than_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="sft.batch_size"):
        SftConfig(batch_size=1, launch={"nproc_per_node": 2})
    with pytest.raises(ValueError, match="torchrun on one node"):
        SftConfig(launch={"launcher": "deepspeed"})


@pytest.mark.slow
def test_the_sft_stage_with_two_processes_saves_the_single_process_model(tmp_path: Path) -> None:
    """The stage itself: its torchrun workers save the folder, the stage measures it (held-out loss,
    chat samples) and reports the steps, and the weights are those ``sft.train`` learns in one process."""
    import json

    from transformers import AutoModelForCausalLM

    from llmpipe.config import load_config
    from llmpipe.pipeline import load_stages
    from llmpipe.posttrain import sft
    from llmpipe.posttrain.curate import read_kept
    from llmpipe.posttrain.data import split
    from llmpipe.posttrain.stage import load_model
    from llmpipe.stage import StageContext
    from llmpipe.store import ArtifactStore
    from tests.conftest import ROOT

    src = make_tiny_checkpoint(tmp_path / "ckpt")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt[0][1], "response": p.response + suffix}) + "\n"
                            for suffix in ("", " indeed") for p in PAIRS))
    pipeline = load_config(ROOT / "configs" / "tiny-chat.yaml", [
        f"sft.data=[{data}]", "sft.max_steps=3", "sft.batch_size=5", "sft.lr=1e-3", "sft.max_length=64",
        "sft.held_out=0.2", "sft.decontaminate_ngram=null", "sft.curation.langid=null", "sft.curation.quality=null",
        "sft.curation.dedup=null", "sft.launch.nproc_per_node=2", "sft.launch.device=cpu",
        "sft.launch.threads_per_process=1"])
    cfg = pipeline.sft
    spec = load_stages()["sft"]
    out = tmp_path / "out"
    out.mkdir()
    steps: list[int] = []
    ctx = StageContext(spec=spec, config=cfg, pipeline=pipeline, key="test-sft", out=out, inputs={"pretrain": src},
                       input_keys={"pretrain": "test"}, store=ArtifactStore(tmp_path / "store"),
                       on_progress=lambda _d, done, _t: steps.append(done))
    stats = spec.fn(ctx)
    assert steps == [1, 2, 3] and stats["steps"] == 3 and len(stats["samples"]) > 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    train_pairs, held = split(read_kept(out, "instructions"), cfg.held_out)  # what the stage trained on
    assert len(train_pairs) >= 10
    model, tok = load_model(src, "test")
    torch.set_num_threads(1)
    sft.train(model, tok, train_pairs, steps=3, batch_size=5, lr=1e-3, weight_decay=0.0, max_length=64, seed=0,
              packing=True)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=2e-5, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert stats["held_out_response_loss"] == pytest.approx(sft.response_loss(model, tok, held, 64), rel=1e-4)


@pytest.mark.slow
def test_a_failing_worker_is_named_with_its_error(tmp_path: Path) -> None:
    """Pretraining's failure report: the rank and its exception, from the workers' error files."""
    from llmpipe.posttrain.sft_launch import launch_sft
    from llmpipe.training.launch import TrainingError

    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainingError, match=r"rank \d failed: PostTrainError: .*no causal-LM checkpoint folder"):
        launch_sft(_cfg("ddp", 2), tmp_path / "empty", PAIRS, tmp_path / "out", tmp_path / "run")
