"""Real multi-process training under torchrun (2 CPU processes, gloo, tiny model).

One DDP run through the ``pretrain`` stage is the reference. Every strategy (DDP, FSDP2, ZeRO-1/2/3,
ZeRO-2 + optimizer offload, tensor parallel on 2 ranks, FSDP2 x tensor parallel on 4, 2 pipeline
stages, 2 pipeline stages x 2 FSDP2 replicas on 4, 2 stages x 2 tensor ranks on 4, and 2 x 2 x 2 FSDP2
replicas on 8: 3-D) and the
two-"node" loopback run is then killed after step 5, resumed
from its step-3 checkpoint, and must reproduce the reference loss at every step: bitwise for DDP,
within 1e-5 for the others (all are the same fp32 math on the same global batches).

The model-parallel layouts are also compared with one process, loss and gradient norm at every step.
Each layout's killed-and-resumed run is made once (:func:`kill_resume_runs`) and checked by both
tests: a torchrun start of 4-8 workers on 2 cores is mostly imports (the 3-D run took 36 s a start),
and a second, uninterrupted run of the same layout only for the one-process comparison repeated it.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from llmpipe.stage import STAGES, StageContext
from llmpipe.store import ArtifactStore
from llmpipe.tokenization.layout import TOKENIZER
from llmpipe.training.config import TrainConfig
from llmpipe.training.launch import TrainingError, free_port, launch
from llmpipe.training.stage import run_pretrain  # noqa: F401 - registers the stage
from tests.fixtures import faulty_trainer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


class Stop(Exception):
    """Raised from the metric callback: the launcher kills every worker (a real SIGTERM/SIGKILL)."""


def _tokenizer_dir(root: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    # the ids the tokenizer stage records, which the model is built and exported with (t0 ends a text)
    meta = {"vocab_size": vocab, "bos_id": 0, "eos_id": 0, "pad_id": None, "source": "test"}
    (root / TOKENIZER.meta).write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train) -> dict[str, Any]:
    """The pretrain stage end to end with DDP: artifact, metrics, loss curve, tokenizer copied in."""
    from llmpipe.config import load_config

    root = tmp_path_factory.mktemp("stage")
    pipe = load_config(data={"train": tiny_train()})
    out = root / "out"
    out.mkdir()
    progress: list[tuple[int, int]] = []
    ctx = StageContext(spec=STAGES["pretrain"], config=pipe.train, pipeline=pipe, key="k" * 64, out=out,
                       inputs={"tokenize": packed, "tokenizer": _tokenizer_dir(root / "tok", 128)},
                       input_keys={}, store=ArtifactStore(root / "store"),
                       on_progress=lambda d, a, b: progress.append((a, b)))
    stats = run_pretrain(ctx)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"out": out, "stats": stats, "losses": [m["loss"] for m in metrics], "progress": progress,
            "ctx": ctx, "metrics": metrics}


def test_stage_artifact(reference: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out, losses = reference["out"], reference["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.2
    for name in ("model.safetensors", "config.json", "tokenizer.json", "loss_curve.png"):
        assert (out / name).stat().st_size > 0, name
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    assert PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")).vocab_size == 128
    assert reference["progress"][-1] == (6, 6)
    st = reference["stats"]
    assert st["world_size"] == 2 and st["steps"] == 6 and st["tokens_per_s"] > 0 and st["nonfinite_steps"] == 0
    assert st["step_time_s"] > 0 and st["peak_mem_mb"] > 0 and st["threads_per_process"] >= 1
    # the artifact's metrics are results only (same key, same bytes); speed and memory are stats
    assert all(set(m) == {"step", "loss", "lr", "grad_norm", "skipped", "tokens"} for m in reference["metrics"])
    kinds = {r.kind: r for r in reference["ctx"].reports}
    assert set(kinds) == {"stats", "image"} and "tokens_per_s" in kinds["stats"].payload


def _kill_and_resume(root: Path, packed: Path, worker_spec, train: dict[str, Any], nodes: int = 1) -> list[float]:
    """Kill after step 5 (checkpoint at 3), resume, return the loss of steps 1..6 as metrics.jsonl has them."""
    def run(stop_at: int | None) -> None:
        port = free_port()
        rdzv = {"rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": "loop"} if nodes > 1 else {}
        cfgs = [TrainConfig(**dict(train, launch={**train["launch"], "nodes": nodes, "node_rank": r,
                                                  "nproc_per_node": train["launch"]["nproc_per_node"] // nodes,
                                                  **rdzv}))
                for r in range(nodes)]

        def on_metric(rec: dict[str, Any]) -> None:
            if stop_at is not None and rec["step"] >= stop_at:
                raise Stop()

        errors: list[BaseException] = []

        def one(c: TrainConfig) -> None:
            try:
                launch(c.launch, worker_spec(c, packed, root), root, on_metric=on_metric)
            except BaseException as e:  # noqa: BLE001 - collected for the assertions below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(c,)) for c in cfgs]
        for i, t in enumerate(threads):
            if i:  # node 0 first, as a cluster starts it: its agent hosts the c10d store the others join
                time.sleep(3)
            t.start()
        for t in threads:
            t.join()
        if stop_at is None:
            assert not errors, errors
        else:
            assert any(isinstance(e, Stop) for e in errors), errors

    run(stop_at=5)
    assert (root / "checkpoints/step_00000003/state.json").exists()
    assert not (root / "export").exists()
    run(stop_at=None)
    metrics = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (root / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000006"]
    return [m["loss"] for m in metrics]


STRATEGY_CASES = {
    "ddp": {"strategy": "ddp"},
    "fsdp2": {"strategy": "fsdp2"},
    "zero1": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero1.json")},
    "zero2": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero2.json")},
    "zero3": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero3.json")},
    "zero2_offload": {"strategy": "deepspeed", "deepspeed": str(REPO / "configs/deepspeed/zero2_offload.json")},
    "tensor2": {"parallel": {"tensor": 2}},  # one replica split over both ranks (DTensor)
    # 2 replicas x 2 tensor ranks: FSDP2 over the data dimension of a 2-D mesh (torchtitan's FSDP x TP)
    "fsdp2_x_tensor2": {"strategy": "fsdp2", "parallel": {"tensor": 2}, "launch": {"nproc_per_node": 4}},
    "pipeline2": {"parallel": {"pipeline": 2}},  # one decoder layer per rank, 1F1B over 4 micro-batches
    # 2 stages x 2 replicas: each stage FSDP2-sharded over its replicas on a (dp, pp) mesh (torchtitan's PP x FSDP)
    "pipeline2_x_data2": {"strategy": "fsdp2", "parallel": {"pipeline": 2}, "launch": {"nproc_per_node": 4}},
    # 2 stages, each split over 2 tensor ranks; then x 2 FSDP2 replicas: 3-D on 8 ranks
    "pipeline2_x_tensor2": {"parallel": {"pipeline": 2, "tensor": 2}, "launch": {"nproc_per_node": 4}},
    "pipeline2_x_tensor2_x_data2": {"strategy": "fsdp2", "parallel": {"pipeline": 2, "tensor": 2},
                                    "launch": {"nproc_per_node": 8}},
}
PARALLEL_CASES = {**STRATEGY_CASES, "pipeline2_gpipe": {"parallel": {"pipeline": 2, "schedule": "gpipe"}}}


@pytest.fixture(scope="module")
def kill_resume_runs(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train,
                     worker_spec) -> Any:
    """``run(case)``: the folder of ``case``'s killed-and-resumed run (:func:`_kill_and_resume`), made on
    the first call and reused by the later ones (its metrics.jsonl holds steps 1..6, ``export/`` the model)."""
    done: dict[str, Path] = {}

    def run(case: str) -> Path:
        if case not in done:
            root = tmp_path_factory.mktemp(f"kill-resume-{case}")
            _kill_and_resume(root, packed, worker_spec, tiny_train(**STRATEGY_CASES[case]))
            done[case] = root
        return done[case]

    return run


@pytest.mark.parametrize("case", list(STRATEGY_CASES))
def test_strategy_kill_resume_export(case: str, reference: dict[str, Any], kill_resume_runs: Any) -> None:
    from transformers import AutoModelForCausalLM

    tmp_path = kill_resume_runs(case)
    losses = [json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ref = reference["losses"]
    if case == "ddp":
        assert losses == ref  # bitwise
    else:
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) <= 1e-5, (losses, ref)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ref_model = AutoModelForCausalLM.from_pretrained(reference["out"])
    for (k, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-4), k


def test_two_node_loopback_matches_single_node(reference: dict[str, Any], tmp_path: Path, packed: Path,
                                               tiny_train, worker_spec) -> None:
    """Two torchrun agents (node_rank 0 and 1, one process each) meet at a c10d rendezvous on 127.0.0.1.

    Two agents started at the same instant on a loaded 2-core machine can miss each other at the
    rendezvous (the second agent's join fails and the first waits for it until the launcher's timeout).
    That race is outside llmpipe: node 0 starts first, each attempt is bounded to 120 s, and the test
    tries up to three times, each in a fresh folder; three failures fail the test.
    """
    errors: list[BaseException] = []
    for attempt in range(3):
        root = tmp_path / f"attempt{attempt}"
        root.mkdir()
        try:
            losses = _kill_and_resume(root, packed, worker_spec, tiny_train(launch={"timeout_s": 120}), nodes=2)
            break
        except (AssertionError, TrainingError) as e:
            errors.append(e)
    else:
        raise AssertionError(f"two-node loopback failed three times: {errors}")
    assert max(abs(a - b) for a, b in zip(losses, reference["losses"], strict=True)) <= 1e-5


def test_worker_failure_names_rank_and_timeout(tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    cfg = TrainConfig(**tiny_train())
    with pytest.raises(TrainingError, match=r"training worker rank 1 failed: RuntimeError: injected failure"):
        launch(cfg.launch, worker_spec(cfg, packed, tmp_path / "a", test_fail_rank=1), tmp_path / "a",
               env={"PYTHONPATH": str(REPO)}, module=faulty_trainer.MODULE)
    # a rank killed by a signal (no Python exception handler runs) is named, with its Python stack
    with pytest.raises(TrainingError, match=r"training worker rank 0 failed: Fatal Python error: Aborted") as died:
        launch(cfg.launch, worker_spec(cfg, packed, tmp_path / "c", test_abort_rank=0), tmp_path / "c",
               env={"PYTHONPATH": str(REPO)}, module=faulty_trainer.MODULE)
    assert "in forward" in str(died.value) and "faulty_trainer.py" in str(died.value), died.value
    slow = TrainConfig(**tiny_train(launch={"timeout_s": 2}))
    with pytest.raises(TrainingError, match=r"timed out after 2s \(train\.launch\.timeout_s\)"):
        launch(slow.launch, worker_spec(slow, packed, tmp_path / "b"), tmp_path / "b")


def _losses(root: Path, packed: Path, worker_spec, train: dict[str, Any]) -> list[dict[str, Any]]:
    cfg = TrainConfig(**train)
    launch(cfg.launch, worker_spec(cfg, packed, root), root)
    assert not list(root.glob("errors/*.fatal"))  # no rank died of a signal: none of their dump files stays
    return [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train, worker_spec) -> list[dict[str, Any]]:
    """10 steps in one process: the reference of the uninterrupted model-parallel runs."""
    train = tiny_train(max_steps=10, checkpoint={"every": 0}, launch={"nproc_per_node": 1})
    return _losses(tmp_path_factory.mktemp("one"), packed, worker_spec, train)


@pytest.fixture(scope="module")
def one_process_6(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train,
                  worker_spec) -> list[dict[str, Any]]:
    """The kill/resume runs' 6 steps (the schedule follows max_steps) in one process, uninterrupted."""
    train = tiny_train(checkpoint={"every": 0}, launch={"nproc_per_node": 1})
    return _losses(tmp_path_factory.mktemp("one6"), packed, worker_spec, train)


@pytest.mark.parametrize("case", ["tensor2", "fsdp2_x_tensor2", "pipeline2", "pipeline2_gpipe", "pipeline2_x_data2",
                                  "pipeline2_x_tensor2", "pipeline2_x_tensor2_x_data2"])
def test_tensor_parallel_matches_one_process(case: str, request: pytest.FixtureRequest, tmp_path: Path,
                                             packed: Path, tiny_train, worker_spec) -> None:
    """Tensor parallel (heads and MLP split, DTensor) on 2 ranks, FSDP2 x TP on 4, 2 pipeline
    stages (1F1B and GPipe), 2 stages x 2 FSDP2 replicas on 4, 2 stages x 2 tensor ranks on 4 and the
    3-D 2 x 2 x 2 on 8, against one process: the same global batches, so the same losses and gradient
    norms up to float summation order. A layout with a kill/resume case is checked on that run (6 steps,
    killed after step 5 and resumed from step 3) against one process's 6 steps; GPipe, which has none,
    on an uninterrupted run of 10 steps against one process's 10."""
    if case in STRATEGY_CASES:
        steps, tp_dir = 6, request.getfixturevalue("kill_resume_runs")(case)
        one = request.getfixturevalue("one_process_6")
    else:
        steps, tp_dir = 10, tmp_path
        _losses(tp_dir, packed, worker_spec, tiny_train(**PARALLEL_CASES[case], max_steps=10, checkpoint={"every": 0}))
        one = request.getfixturevalue("one_process")
    assert not list(tp_dir.glob("errors/*.fatal"))  # no rank died of a signal (SIGSEGV, SIGABRT, ...)
    tp = [json.loads(x) for x in (tp_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in tp] == [m["step"] for m in one] == list(range(1, steps + 1))
    assert json.loads((tp_dir / "summary.json").read_text())["engine"] == ("pp" if "pipeline" in case else "tp")
    assert one[-1]["loss"] < one[0]["loss"] - 0.2  # it learns, so the comparison means something
    for key in ("loss", "grad_norm"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(one, tp, strict=True))
        print(f"{case} vs one process: max |d {key}| = {diff:.2e}")
        assert diff <= 1e-5, (key, diff, [m[key] for m in one], [m[key] for m in tp])


@pytest.fixture(scope="module")
def one_process_bf16(tmp_path_factory: pytest.TempPathFactory, packed: Path, tiny_train,
                     worker_spec) -> list[dict[str, Any]]:
    """10 bf16 steps in one process (autocast): the reference of the bf16 model-parallel runs."""
    train = tiny_train(max_steps=10, precision="bf16", checkpoint={"every": 0}, launch={"nproc_per_node": 1})
    return _losses(tmp_path_factory.mktemp("one_bf16"), packed, worker_spec, train)


@pytest.mark.parametrize("case", ["tensor2", "pipeline2_x_data2"])
def test_bf16_model_parallel_matches_one_process_bf16(case: str, one_process_bf16: list[dict[str, Any]],
                                                      one_process: list[dict[str, Any]], tmp_path: Path,
                                                      packed: Path, tiny_train, worker_spec) -> None:
    """bf16 tensor parallel (autocast, as one process) and bf16 pipeline x FSDP2 (FSDP casts the
    parameters to bf16, reduces gradients in fp32) against the one-process bf16 run over 10 steps: the
    loss within half a bf16 ulp (2e-3 relative; measured about 5e-4, the size of bf16 against fp32),
    the grad norm, a sum over every parameter's rounding, within 5e-2 (measured up to 2e-2)."""
    run = _losses(tmp_path, packed, worker_spec, tiny_train(**PARALLEL_CASES[case], precision="bf16", max_steps=10,
                                                           checkpoint={"every": 0}))
    ref = one_process_bf16
    assert [m["step"] for m in run] == list(range(1, 11)) and ref[-1]["loss"] < ref[0]["loss"] - 0.2
    for key in ("loss", "grad_norm"):
        rel = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(run, ref, strict=True))
        fp32 = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(one_process, ref, strict=True))
        print(f"{case} bf16 vs one process bf16: max rel |d {key}| = {rel:.2e} (fp32 vs bf16: {fp32:.2e})")
        assert rel <= {"loss": 2e-3, "grad_norm": 5e-2}[key], (key, rel, [m[key] for m in ref], [m[key] for m in run])
