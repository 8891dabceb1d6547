"""Config section of the ``entities`` stage.

Example::

    entities:
      enabled: true
      recognizers: {"*": [rules], en: [rules, ner]}   # per language; "*" for every other one
      rules:
        gazetteers: [names.tsv]        # surface form<TAB>label, one a line
      ner:
        model: models/ner-checkpoint   # a transformers token-classification checkpoint (by path)
      redact: [PER]                    # person names found become <PER>, counted like PII
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting

RuleKind = Literal["date", "time", "quantity", "money", "percent", "url", "email"]
RecognizerName = Literal["rules", "ner"]
ALL_RULES: list[RuleKind] = ["date", "time", "quantity", "money", "percent", "url", "email"]


class RuleSettings(Section):
    """The rule recognizer: patterns matched on the NFKC form of the text, and user gazetteers."""

    kinds: list[RuleKind] = Field(default_factory=lambda: list(ALL_RULES),
                                  description="pattern families (labels DATE, TIME, QUANTITY, MONEY, PERCENT, URL, EMAIL)")
    gazetteers: list[str] = Field(
        default_factory=list, description="TSV files 'surface form<TAB>label' (names, products, places); "
                                          "CJK forms match on characters, others on word boundaries")


class NerSettings(Section):
    """A transformers token-classification checkpoint (BIO or plain labels), loaded by path."""

    model: str | None = Field(None, description="directory of the checkpoint and its fast tokenizer")
    min_score: float = Field(0.5, description="entities whose mean token probability is lower are dropped")
    max_length: int = Field(256, ge=8, description="tokens per window; longer documents are read in windows")
    stride: int = Field(32, ge=0, description="tokens shared by consecutive windows")
    labels: list[str] = Field(default_factory=list, description="keep only these labels; empty = all")
    batch_size: int = run_setting(32, gt=0, description="windows per forward pass")
    device: str = run_setting("cpu", description="torch device")

    @field_validator("min_score")
    @classmethod
    def _unit(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _stride(self) -> NerSettings:
        if self.stride >= self.max_length // 2:
            raise ValueError(f"stride {self.stride} must be under half of max_length {self.max_length}")
        return self


class EntitiesConfig(Section):
    """Tag entity spans in ``metadata["entities"]``; off, the stage passes its input through."""

    enabled: bool = False
    recognizers: dict[str, list[RecognizerName]] = Field(
        default_factory=lambda: {"*": ["rules"]},
        description="language -> recognizers, in priority order; '*' = any other language")
    rules: RuleSettings = Field(default_factory=RuleSettings)
    ner: NerSettings = Field(default_factory=NerSettings)
    redact: list[str] = Field(
        default_factory=list, description="labels whose spans are redacted like PII: '<LABEL>' in the text, "
                                          "counted in metadata.pii (e.g. [PER]); empty = none")
    top_k: int = Field(10, gt=0, description="most frequent entities per label in entities.json and the table")
    batch_size: int = run_setting(256, gt=0, description="documents per recognizer call")
    max_error_share: float = run_setting(
        0.01, ge=0, le=1, description="the stage fails when more than this share of its documents hit a "
        "filter error (quarantined as error:<Type>): a recognizer that raises on many documents is broken")

    @model_validator(mode="after")
    def _ner_model(self) -> EntitiesConfig:
        uses_ner = any("ner" in names for names in self.recognizers.values())
        if self.enabled and uses_ner and not self.ner.model:
            raise ValueError("entities.ner.model: a recognizer list names 'ner' but no model path is given")
        for lang, names in self.recognizers.items():
            if len(set(names)) != len(names):
                raise ValueError(f"entities.recognizers.{lang}: each recognizer may appear once, got {names}")
        return self

    def uses(self, name: str) -> bool:
        """Whether some language's list names recognizer ``name`` (whether or not the stage is enabled)."""
        return any(name in names for names in self.recognizers.values())
