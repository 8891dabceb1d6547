"""The prefetching batch loader: the same batches (and losses, bit for bit) with prefetching on and off,
the data wait it hides, an error in its thread raised in the loop, and a thread that ends with the run."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from llmpipe.training.config import TrainConfig
from llmpipe.training.data import BatchLoader
from llmpipe.training.launch import launch
from llmpipe.training.stage import results_only
from llmpipe.training.trainer import Trainer
from tests.fixtures import faulty_trainer
from tests.fixtures.threads import one_thread

REPO = Path(__file__).resolve().parents[3]

LOADER_THREAD = "llmpipe-batch-loader"


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    with one_thread():
        yield


def _cfg(tiny_train: Any, prefetch: int, **over: Any) -> TrainConfig:
    kw: dict[str, Any] = dict(max_steps=5, checkpoint={"every": 0}, watch={"tensorboard": False},
                              launch={"nproc_per_node": 1, "device": "cpu", "prefetch": prefetch})
    kw.update(over)
    return TrainConfig(**tiny_train(**kw))


def _records(root: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == LOADER_THREAD]


def test_prefetching_gives_the_same_batches_losses_and_weights_bit_for_bit(
        tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    runs = {}
    for depth in (0, 2):
        tr = Trainer(worker_spec(_cfg(tiny_train, depth), packed, tmp_path / str(depth)))
        tr.run()
        runs[depth] = ([results_only(r) for r in _records(tmp_path / str(depth))],
                       load_file(tmp_path / str(depth) / "export" / "model.safetensors"))
        assert not _loader_threads()  # the thread ended with the run
    (recs0, w0), (recs2, w2) = runs[0], runs[2]
    assert [r["step"] for r in recs2] == [1, 2, 3, 4, 5]
    assert recs0 == recs2  # loss, lr, grad norm of every step: equal floats, not close ones
    assert w0.keys() == w2.keys() and all(torch.equal(w0[k], w2[k]) for k in w0)
    # and the batches themselves, straight from the loader (3 steps ahead, from step 2 on)
    tr = Trainer(worker_spec(_cfg(tiny_train, 3), packed, tmp_path / "direct"))
    tr.setup()
    loader = BatchLoader(tr.step_batches, tr.device, 2, 7, depth=3)
    try:
        for step in range(2, 7):
            got, _ = loader.get(step)
            want = tr.step_batches(step)
            assert len(got) == len(want) == 4
            assert all(torch.equal(g, w) for gm, wm in zip(got, want, strict=True)
                       for g, w in zip(gm[:2], wm[:2], strict=True))
    finally:
        loader.close()


class SlowData(Trainer):
    """Batches that take 40 ms to assemble and micro-batches that compute 30 ms more (sleeps release the GIL, as
    reading storage and device kernels do)."""

    def step_batches(self, step: int) -> list[Any]:
        time.sleep(0.04)
        return super().step_batches(step)

    def forward(self, ids: Any, targets: Any, entity: Any = None) -> tuple[Any, Any]:
        time.sleep(0.03)
        return super().forward(ids, targets, entity)


def test_the_data_wait_share_shows_a_slow_loader_and_prefetching_hides_it(
        tmp_path: Path, packed: Path, tiny_train, worker_spec, caplog) -> None:
    shares = {}
    for depth in (0, 2):
        with caplog.at_level(logging.INFO, logger="llmpipe.training.trainer"):
            SlowData(worker_spec(_cfg(tiny_train, depth, max_steps=6), packed, tmp_path / str(depth))).run()
        assert re.search(r"step 6/6 loss .* data-wait \d+%", caplog.text), caplog.text
        recs = _records(tmp_path / str(depth))
        assert all(0 <= r["data_wait_share"] < 1 and r["data_wait_s"] >= 0 for r in recs)
        shares[depth] = sorted(r["data_wait_share"] for r in recs[1:])  # step 1: nothing was ahead yet
    assert shares[0][0] > 0.1, shares  # 40 ms of a ~200 ms step (4 micro-batches), every step
    assert shares[2][len(shares[2]) // 2] < 0.05, shares  # built while the previous step computed


class BrokenData(Trainer):
    def step_batches(self, step: int) -> list[Any]:
        if step == 3:
            raise OSError(f"shard unreadable at step {step + 1}")
        return super().step_batches(step)


@pytest.mark.parametrize("depth", [0, 2])
def test_an_error_in_the_loader_thread_is_raised_in_the_loop_with_its_traceback(
        depth: int, tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    tr = BrokenData(worker_spec(_cfg(tiny_train, depth, max_steps=6), packed, tmp_path))
    with pytest.raises(OSError, match="shard unreadable at step 4") as err:
        tr.run()
    frames = [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert "step_batches" in frames  # the frame that raised, in the thread when prefetching
    if depth:
        assert "_work" in frames and "raised in the batch loader thread" in "".join(err.value.__notes__)
    assert tr.step == 3 and len(_records(tmp_path)) == 3  # steps 1-3 trained and logged, then it stopped
    assert not _loader_threads()


def test_closing_the_loader_stops_a_thread_blocked_on_a_full_queue(packed: Path, tiny_train, worker_spec,
                                                                    tmp_path: Path) -> None:
    tr = Trainer(worker_spec(_cfg(tiny_train, 1), packed, tmp_path))
    tr.setup()
    loader = BatchLoader(tr.step_batches, tr.device, 0, 1000, depth=1)
    time.sleep(0.2)  # it filled its one slot and waits
    assert len(_loader_threads()) == 1
    loader.close()
    assert not _loader_threads()
    with pytest.raises(RuntimeError, match=r"asked for step 5, it prefetches step 1 next"):
        BatchLoader(tr.step_batches, tr.device, 0, 10, depth=1).get(4)


@pytest.mark.slow  # two torchrun workers, about 20 s
def test_a_nan_on_one_rank_skips_the_step_on_every_rank_with_one_check_per_step(
        tmp_path: Path, packed: Path, tiny_train, worker_spec) -> None:
    """The non-finite check runs once per step (not per micro-batch): a NaN micro-batch on rank 0 still
    skips that step on both DDP ranks, and the run goes on as one process with the same NaN does."""
    train = tiny_train(checkpoint={"every": 0}, watch={"tensorboard": False})
    cfg = TrainConfig(**train)
    launch(cfg.launch, worker_spec(cfg, packed, tmp_path / "ddp", test_nan_steps=[2]), tmp_path / "ddp",
           env={"PYTHONPATH": str(REPO)}, module=faulty_trainer.MODULE)
    one = TrainConfig(**tiny_train(**dict(train, launch={"nproc_per_node": 1})))
    faulty_trainer.FaultyTrainer(worker_spec(one, packed, tmp_path / "one", test_nan_steps=[2])).run()
    ddp, single = _records(tmp_path / "ddp"), _records(tmp_path / "one")
    assert [r["skipped"] for r in ddp] == [r["skipped"] for r in single] == [False, False, True, False, False, False]
    good = [(a["loss"], b["loss"]) for a, b in zip(ddp, single, strict=True) if not a["skipped"]]
    assert max(abs(a - b) for a, b in good) <= 1e-5, good
