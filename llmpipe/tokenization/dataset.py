"""Random-access reading of packed token shards as a torch ``Dataset``.

``PackedDataset(artifact_dir, split="train")[i]`` is a ``LongTensor`` of ``seq_len + 1`` ids (the
layout is described in :mod:`llmpipe.tokenization.stage`); with ``pairs=True`` it is
``(input, target)``, both ``[seq_len]``, where target positions that are padding hold ``-100``
(the ``ignore_index`` of ``torch.nn.functional.cross_entropy``). Shards are memory-mapped, so a
dataset costs no memory up front and works from DataLoader worker processes.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from llmpipe.tokenization.layout import TOKENIZE

IGNORE_INDEX = -100


class PackedDataset(Dataset):
    """Fixed-length token sequences of one split of a ``tokenize`` artifact."""

    def __init__(self, artifact_dir: str | Path, split: str = "train", pairs: bool = False) -> None:
        self.dir = Path(artifact_dir)
        index_path = self.dir / TOKENIZE.index
        if not index_path.is_file():
            raise FileNotFoundError(f"{index_path}: not a tokenize artifact (no index.json)")
        self.index: dict[str, Any] = json.loads(index_path.read_text())
        if split not in self.index["splits"]:
            raise ValueError(f"split must be one of {sorted(self.index['splits'])}, got {split!r}")
        self.split, self.pairs = split, pairs
        self.seq_len: int = self.index["seq_len"]
        self.dtype = np.dtype(self.index["dtype"])
        self.shards: list[dict[str, Any]] = self.index["splits"][split]["shards"]
        self._starts = np.cumsum([0] + [s["sequences"] for s in self.shards]).tolist()
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} sequences")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, (i - self._starts[k]) * self.seq_len

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.dir / self.shards[k]["file"], dtype=self.dtype, mode="r")
        return self._maps[k]

    def __getitem__(self, i: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        k, start = self._locate(i)
        seq = torch.from_numpy(self._shard(k)[start : start + self.seq_len + 1].astype(np.int64))
        if not self.pairs:
            return seq
        x, y = seq[:-1], seq[1:].clone()
        real = self.shards[k]["tokens"]
        pad_from = max(0, real - start - 1)  # target j is id start+1+j; ids >= real are padding
        y[pad_from:] = IGNORE_INDEX
        return x, y

    def languages(self, i: int) -> np.ndarray:
        """Language index (into ``index["languages"]``) of each target of sequence ``i``; 255 = padding.

        Only the validation split stores languages (for bits per byte by language).
        """
        k, start = self._locate(i)
        lang_file = self.shards[k].get("lang_file")
        if lang_file is None:
            raise ValueError(f"split {self.split!r} stores no per-token languages")
        return np.load(self.dir / lang_file, mmap_mode="r")[start + 1 : start + self.seq_len + 1]

    def entity_mask(self, i: int) -> np.ndarray:
        """1 for each target of sequence ``i`` that overlaps an entity span, else 0 (padding: 0).

        Only artifacts tokenized with ``tokenize.entity_mask`` store it (both splits).
        """
        k, start = self._locate(i)
        name = self.shards[k].get("entity_file")
        if name is None:
            raise ValueError(f"split {self.split!r} stores no entity mask (tokenize.entity_mask is off)")
        return np.load(self.dir / name, mmap_mode="r")[start + 1 : start + self.seq_len + 1]

    @property
    def languages_list(self) -> list[str]:
        return list(self.index["languages"])
