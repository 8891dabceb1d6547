"""Config sections of the tokenizer and tokenize stages."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")  # the chat template's role markers (tokenizer.py)


class TokenizerConfig(Section):
    """Train a byte-level BPE on the curated corpus, or load a pretrained tokenizer by path."""

    pretrained: str | None = Field(None, description="directory of a tokenizer to load instead of training")
    vocab_size: int = Field(8192, description="target vocabulary size, special tokens included")
    min_frequency: int = Field(2, ge=1)
    special_tokens: list[str] = Field(
        default_factory=lambda: ["<|endoftext|>", "<|pad|>", *ROLE_TOKENS],
        description="trained in with one id each: eos/bos, pad, and the chat template's role markers")
    bos_token: str = "<|endoftext|>"
    eos_token: str = "<|endoftext|>"
    pad_token: str = "<|pad|>"
    model_max_length: int = Field(2048, gt=0)
    max_train_docs: int | None = Field(None, gt=0, description="train on at most this many documents")
    batch_size: int = run_setting(1000, gt=0)

    @field_validator("vocab_size")
    @classmethod
    def _vocab(cls, v: int) -> int:
        if not 260 <= v <= 2**31 - 1:
            raise ValueError(f"must be at least 260 (256 bytes + special tokens), got {v}")
        return v

    @model_validator(mode="after")
    def _specials(self) -> TokenizerConfig:
        if self.pretrained is None:
            for name in ("bos_token", "eos_token", "pad_token"):
                tok = getattr(self, name)
                if tok not in self.special_tokens:
                    raise ValueError(f"{name} {tok!r} must be one of special_tokens {self.special_tokens}")
            if missing := [r for r in ROLE_TOKENS if r not in self.special_tokens]:
                raise ValueError(f"special_tokens {self.special_tokens} lacks the chat template's role markers "
                                 f"{missing}: add them")
            if self.pad_token == self.eos_token:
                raise ValueError("pad_token must differ from eos_token (packed shards mark padding apart)")
        return self


class TokenizeConfig(Section):
    """Encode, split train/val, mix and pack documents into fixed-length token sequences."""

    seq_len: int = Field(512, gt=1, description="tokens per training sequence (each item holds seq_len+1)")
    val_fraction: float = Field(0.01, description="share of original documents in the validation split")
    split_salt: str = Field("", description="change to draw a different validation split")
    min_val_docs: int = Field(
        1, ge=0, description="with val_fraction > 0, val holds at least this many original documents")
    min_tokens: int = Field(1, ge=1, description="documents with fewer tokens are dropped (too_short)")
    max_tokens: int | None = Field(None, gt=0, description="longer documents are split or truncated")
    long_docs: Literal["split", "truncate"] = "split"
    add_bos: bool = False
    entity_mask: bool = Field(
        False, description="pack a uint8 mask per token beside the ids: 1 where the token overlaps an entity "
                           "span (metadata.entities, from the entities stage)")
    language_weights: dict[str, float] = Field(
        default_factory=dict, description="train-split sampling factor per language (2 = twice, 0.5 = half)")
    source_weights: dict[str, float] = Field(default_factory=dict, description="sampling factor per source")
    language_shares: dict[str, float] = Field(
        default_factory=dict, description="target token share per language in train (sums to 1)")
    recency_weighting: bool = Field(
        True, description="multiply each train document's sampling factor by its metadata `recency_weight` "
                          "(the timeliness stage's half-life weight; 1 where absent)")
    sequences_per_shard: int = Field(8192, gt=0)
    batch_size: int = run_setting(4096, gt=0, description="documents per encode_batch call")
    batch_chars: int = run_setting(4_000_000, gt=0, description="characters per encode_batch call at most")
    piece_docs: int = run_setting(
        2048, gt=0, description="documents per encode task: larger shards are split so every worker stays busy "
                                "to the end (the output does not depend on it)")

    @field_validator("val_fraction")
    @classmethod
    def _val(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError(f"must be in [0, 1), got {v}")
        return v

    @field_validator("language_weights", "source_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        for k, w in v.items():
            if w < 0:
                raise ValueError(f"weight of {k!r} must be >= 0, got {w}")
        return v

    @field_validator("language_shares")
    @classmethod
    def _shares(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            return v
        if any(s < 0 for s in v.values()):
            raise ValueError(f"shares must be >= 0, got {v}")
        if abs(sum(v.values()) - 1.0) > 1e-6:
            raise ValueError(f"shares must sum to 1, got {sum(v.values()):.6g}")
        return v

    @model_validator(mode="after")
    def _one_language_mix(self) -> TokenizeConfig:
        if self.language_shares and self.language_weights:
            raise ValueError("set language_shares or language_weights, not both")
        return self
