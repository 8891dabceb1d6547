"""The declared layouts of the ``tokenizer`` and ``tokenize`` artifacts: the names other stages join.

A module of its own (no imports of ours), so a consumer (training, evaluation) reads the declaration
without importing the stages and their dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizerLayout:
    """The files of a tokenizer artifact that other stages read: consumers join these names, never literals."""

    tokenizer: str = "tokenizer.json"  # the fast tokenizer (``tokenizers`` format)
    config: str = "tokenizer_config.json"  # transformers' settings: bos/eos/pad, max length
    meta: str = "llmpipe_tokenizer.json"  # {"vocab_size", "bos_id", "eos_id", "pad_id", "source"}


TOKENIZER = TokenizerLayout()


@dataclass(frozen=True)
class TokenizeLayout:
    """The files of a tokenize artifact that other stages read (the shard files are named in the index)."""

    index: str = "index.json"  # format, seq_len, dtype, ids, languages, and per split its shard files
    val_meta: str = "val_meta.json"  # docs, bytes, tokens of the val split per language
    # with tokenize.entity_mask: beside each shard file, uint8 per token (1 = overlaps an entity span);
    # the index names it per shard ("entity_file") and says "entity_mask": true
    entity_suffix: str = ".entity.npy"


TOKENIZE = TokenizeLayout()
