"""Held-out sequences of a tokenize artifact, as :class:`EvalSequence` lists.

The tokenize stage stores one language index per validation *target*
(``PackedDataset.languages``), so per-language numbers are exact even when a packed sequence spans
documents of several languages. Splits without that array (e.g. a train sample) are labelled
``und``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.evaluation.metrics import EvalSequence
from llmpipe.tokenization.layout import TOKENIZE


def evenly_spaced(n: int, k: int | None) -> list[int]:
    """``k`` indices spread over ``range(n)`` (all of them when ``k`` is None or >= n): a sample that
    covers the whole split instead of its first shard, and the same one every run."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({int(i) for i in np.linspace(0, n - 1, k).round()})


def load_sequences(tokenize_dir: str | Path, split: str = "val", max_sequences: int | None = None
                   ) -> tuple[list[EvalSequence], list[str], dict[str, Any]]:
    """(sequences, language names, split metadata) of one split of a tokenize artifact."""
    from llmpipe.training.data import open_packed

    if (Path(tokenize_dir) / TOKENIZE.index).is_file():  # the tokenize stage's layout: whole sequences
        from llmpipe.tokenization.dataset import PackedDataset

        ds: Any = PackedDataset(tokenize_dir, split, pairs=False)
    else:
        ds = open_packed(tokenize_dir, split)
    if len(ds) == 0:
        raise ValueError(f"evaluate.split: split {split!r} of {tokenize_dir} holds no sequences")
    names = list(getattr(ds, "languages_list", []) or [])
    seqs = []
    for i in evenly_spaced(len(ds), max_sequences):
        tokens = np.asarray(ds[i], dtype=np.int64)
        lang: Any = None
        if names and hasattr(ds, "languages"):
            try:
                lang = np.asarray(ds.languages(i), dtype=np.int64)
            except ValueError:  # this split stores no per-token languages
                lang = None
        entity = (np.asarray(ds.entity_mask(i), dtype=np.uint8)
                  if getattr(ds, "index", {}).get("entity_mask") else None)
        seqs.append(EvalSequence(tokens, lang, entity))
    meta_path = Path(tokenize_dir) / f"{split}_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta.update({"split": split, "sequences_total": len(ds), "sequences_used": len(seqs)})
    return seqs, names, meta


def split_token_arrays(tokenize_dir: str | Path, split: str) -> tuple[dict[str, Any], Iterator[np.ndarray]]:
    """(the tokenize artifact's index, each shard of ``split`` as its real tokens, memory-mapped); errors name
    the index file and the splits it has."""
    tokenize_dir = Path(tokenize_dir)
    index_path = tokenize_dir / TOKENIZE.index
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path}: not a tokenize artifact (no index.json)")
    index = json.loads(index_path.read_text())
    if split not in index["splits"]:
        raise ValueError(f"{index_path}: no split {split!r} (has {sorted(index['splits'])})")
    dtype = np.dtype(index["dtype"])
    shards = index["splits"][split]["shards"]
    return index, (np.memmap(tokenize_dir / s["file"], dtype=dtype, mode="r")[: int(s["tokens"])] for s in shards)
