"""The declared layout of a ``pretrain`` artifact: the names other stages, the server and the tests join.

A module of its own (no imports of ours), so a consumer reads the declaration without importing
the stage and its dependencies, and no import cycle can form through it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PretrainLayout:
    """The files of a pretrain artifact that other stages read: consumers join these names, never literals."""

    checkpoint: str = "."  # the save_pretrained folder (config.json, weights, tokenizer files): the root
    metrics: str = "metrics.jsonl"  # one results-only record per logged step
    loss_curve: str = "loss_curve.png"
    lr_find: str = "lr_find.json"  # train.lr_find on: the sweep (lr, loss per step) and its suggestion
    lr_find_curve: str = "lr_find.png"


PRETRAIN = PretrainLayout()
