"""``train.loss``: off is plain cross-entropy, bit for bit; weighted entity targets learn faster."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmpipe.training.config import LossConfig, TrainConfig
from llmpipe.training.engines import _loss, entity_loss, token_loss
from llmpipe.training.trainer import Trainer


def _logits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g)
    targets = torch.randint(0, 11, (2, 6), generator=g)
    targets[1, 4:] = -100  # padding
    mask = (targets % 3 == 0).to(torch.uint8)
    return logits, targets, mask


def test_off_is_the_plain_cross_entropy_call_and_the_forms_reduce_to_it() -> None:
    logits, targets, mask = _logits()
    off = TrainConfig()
    assert torch.equal(_loss(logits, targets, mask, off), token_loss(logits, targets))
    ce = token_loss(logits, targets)
    assert torch.allclose(entity_loss(logits, targets, mask, LossConfig(entity_weight=1.0)), ce)
    assert torch.allclose(entity_loss(logits, targets, torch.ones_like(mask), LossConfig(entity_weight=2.0)), 2 * ce)
    assert torch.allclose(entity_loss(logits, targets, mask, LossConfig(kind="seed_reward", entity_weight=1.0,
                                                                         alpha=1.0)), ce)
    seed = entity_loss(logits, targets, mask, LossConfig(kind="seed_reward", entity_weight=1.0, alpha=0.0))
    assert -1.0 <= float(seed) < 0.0  # minus the mean probability of the entity targets: below zero


class _Masked:
    """The packed fixture with an entity mask: targets of token id below 4 are 'entities'."""

    def __init__(self, source) -> None:
        self.source, self.seq_len = source, source.seq_len

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        return self.source[i]

    def entity_mask(self, i: int) -> np.ndarray:
        return (np.asarray(self.source[i][1]) < 4).astype(np.uint8)


def _trained(tmp: Path, packed: Path, worker_spec, tiny_train, weight: float | None, masked: bool = True,
             steps: int = 30) -> Trainer:
    cfg = TrainConfig(**tiny_train(max_steps=steps, checkpoint={"every": 0}, launch={"nproc_per_node": 1},
                                   loss={"entity_weight": weight}))
    trainer = Trainer(worker_spec(cfg, packed, tmp))
    trainer.setup()
    if masked:
        trainer.source = _Masked(trainer.source)
    for step in range(steps):
        trainer.step = step
        trainer.train_step()
    return trainer


def _entity_ce(tmp: Path, packed: Path, worker_spec, tiny_train, weight: float | None) -> float:
    trainer = _trained(tmp, packed, worker_spec, tiny_train, weight)
    x, y = zip(*(trainer.source[i] for i in range(len(trainer.source))), strict=True)
    ids, targets = torch.stack(x), torch.stack(y)
    with torch.no_grad():
        logits = trainer.engine.model(input_ids=ids).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           reduction="none")
    return float(ce[(targets.reshape(-1) < 4)].mean())


@pytest.mark.slow  # two 30-step runs of the tiny model, about 10 CPU-seconds
def test_weighting_entity_targets_lowers_their_loss(tmp_path: Path, packed: Path, worker_spec, tiny_train) -> None:
    torch.set_num_threads(1)
    plain = _entity_ce(tmp_path / "plain", packed, worker_spec, tiny_train, None)
    weighted = _entity_ce(tmp_path / "weighted", packed, worker_spec, tiny_train, 2.0)
    print(f"entity-target CE after 30 steps: plain {plain:.4f}, entity_weight 2: {weighted:.4f}")
    assert weighted < plain, (weighted, plain)


def test_by_default_the_weights_are_bit_identical_to_training_without_the_feature(
        tmp_path: Path, packed: Path, worker_spec, tiny_train) -> None:
    """The default loss on data that carries an entity mask trains exactly the weights of plain data."""
    torch.set_num_threads(1)
    with_mask = _trained(tmp_path / "a", packed, worker_spec, tiny_train, None, masked=True, steps=6)
    without = _trained(tmp_path / "b", packed, worker_spec, tiny_train, None, masked=False, steps=6)
    a, b = with_mask.engine.model.state_dict(), without.engine.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
