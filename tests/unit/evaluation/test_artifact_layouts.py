"""Consumers find an upstream artifact's files where its producer's layout declares them, nowhere else."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import llmpipe.quantization.layout as quantize_layout
from llmpipe.evaluation.model_io import find_checkpoint, load_tokenizer
from llmpipe.quantization.stage import QUANTIZE
from llmpipe.serving.repository import REPO_DIR
from llmpipe.serving.stage import DEPLOY
from llmpipe.tokenization.layout import TOKENIZE
from llmpipe.training.stage import PRETRAIN


def _quantize_shaped(pretrain: Path, root: Path, checkpoint: str) -> Path:
    """A quantize-shaped artifact: the pretrain checkpoint's files under ``checkpoint``."""
    shutil.copytree(pretrain / PRETRAIN.checkpoint, root / checkpoint)
    return root


def test_find_checkpoint_on_pretrain_and_quantize_artifacts(toy_lm, tmp_path: Path) -> None:  # noqa: ANN001
    assert find_checkpoint(toy_lm.pretrain) == toy_lm.pretrain / PRETRAIN.checkpoint
    assert load_tokenizer(find_checkpoint(toy_lm.pretrain)).vocab_size > 0  # tokenizer files sit in it
    q = _quantize_shaped(toy_lm.pretrain, tmp_path / "quantize", QUANTIZE.checkpoint)
    assert find_checkpoint(q) == q / QUANTIZE.checkpoint


def test_find_checkpoint_does_not_guess_other_folders(toy_lm, tmp_path: Path) -> None:  # noqa: ANN001
    odd = _quantize_shaped(toy_lm.pretrain, tmp_path / "odd", "hf")  # a name no stage declares
    with pytest.raises(FileNotFoundError, match=rf"no HF checkpoint .*quantize: {QUANTIZE.checkpoint}/config.json"):
        find_checkpoint(odd)


def test_find_checkpoint_follows_the_quantize_declaration(toy_lm, tmp_path: Path,  # noqa: ANN001
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    moved = replace(QUANTIZE, checkpoint="weights")
    monkeypatch.setattr(quantize_layout, "QUANTIZE", moved)  # our own declaration, not a library's
    q = _quantize_shaped(toy_lm.pretrain, tmp_path / "quantize", "weights")
    assert find_checkpoint(q) == q / "weights"


def test_shared_file_names_come_from_the_producers(toy_lm) -> None:  # noqa: ANN001
    from llmpipe.tokenization.dataset import PackedDataset

    assert (toy_lm.tokenize / TOKENIZE.index).is_file()  # what the tokenize stage wrote
    assert len(PackedDataset(toy_lm.tokenize, "train")) > 0
    with pytest.raises(FileNotFoundError, match=TOKENIZE.index):
        PackedDataset(toy_lm.pretrain, "train")
    assert REPO_DIR == DEPLOY.repository  # the server and the deploy stage agree on the folder
