"""Config section of the augment stage.

Operators are declared as a list; each has a ``type`` (which operator), a ``fraction`` (the share of
input documents it touches, chosen by a seeded hash of the document id) and a ``probability`` (how
much of a touched document it changes: per word for replacements, per paragraph for restructuring).
Example::

    augment:
      enabled: true
      seed: 13
      operators:
        - {type: synonym, fraction: 0.2, probability: 0.15}
        - {type: contextual, fraction: 0.05, probability: 0.1, model: models/tiny-mlm}
        - {type: back_translation, fraction: 0.05, chain: [models/zh-en, models/en-zh], languages: [zh]}
        - {type: restructure, fraction: 0.1, probability: 0.5}
        - {type: template, fraction: 0.05, templates: ["{ENTITY} reported {NUMBER} cases."]}
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting


class _OperatorBase(Section):
    name: str | None = Field(None, description="label in stats and ids; defaults to the type")
    fraction: float = Field(0.1, description="share of input documents this operator touches")
    probability: float = Field(0.15, description="how much of a touched document changes")
    languages: list[str] = Field(default_factory=list, description="only documents in these languages")

    @field_validator("fraction", "probability")
    @classmethod
    def _unit(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @property
    def label(self) -> str:
        return self.name or str(self.type)


class SynonymOp(_OperatorBase):
    """Replace words with synonyms from TSV tables (``word<TAB>syn1<TAB>syn2...``)."""

    type: Literal["synonym"] = "synonym"
    tables: dict[str, list[str]] = Field(
        default_factory=dict,
        description="language -> TSV files; empty uses the shipped en and zh tables")
    max_replacements: int = Field(64, gt=0)


class ContextualOp(_OperatorBase):
    """Replace words with a masked LM's predictions (transformers fill-mask, loaded by path)."""

    type: Literal["contextual"] = "contextual"
    model: str = Field(..., min_length=1, description="directory of a masked LM and its tokenizer")
    top_k: int = Field(5, gt=0)
    max_replacements: int = Field(16, gt=0)
    window_chars: int = Field(200, gt=0, description="context on each side of a masked word")
    batch_size: int = run_setting(32, gt=0)


class BackTranslationOp(_OperatorBase):
    """Translate through a chain of seq2seq models (e.g. zh->en->zh) to paraphrase."""

    type: Literal["back_translation"] = "back_translation"
    chain: list[str] = Field(..., min_length=1, description="model directories applied in order")
    max_new_tokens: int = Field(128, gt=0)
    num_beams: int = Field(1, gt=0)
    max_sentences: int = Field(32, gt=0, description="longer documents translate their first sentences")
    batch_size: int = run_setting(16, gt=0)


class RestructureOp(_OperatorBase):
    """Reorder sentences (or clauses) inside paragraphs; spaCy sentences when ``parser`` is installed."""

    type: Literal["restructure"] = "restructure"
    unit: Literal["sentence", "clause"] = "sentence"
    parser: str | None = Field(None, description="spaCy pipeline name, used only where spaCy is installed")


class TemplateOp(_OperatorBase):
    """Fill templates' ``{SLOT}``s from value lists or from entities found in the document / shard.

    Inline ``templates`` apply to every language; file templates to their ``[lang]`` section.
    """

    type: Literal["template"] = "template"
    templates: list[str] = Field(default_factory=list, description="inline templates")
    templates_file: str | None = Field(
        None, description="one template per line, '[lang]' lines start a language; default: shipped file")
    values: dict[str, list[str]] = Field(default_factory=dict, description="slot -> values")
    entity_slots: dict[str, str] = Field(
        default_factory=lambda: {"ENTITY": "capitalized", "NUMBER": "number"},
        description="slot -> 'capitalized' or 'number' (found by pattern in the document, else its shard), "
                    "or an entity label (PER, DATE, ...: the document's own entities of that label)")
    per_document: int = Field(1, gt=0, description="filled templates per touched document")

    @model_validator(mode="after")
    def _slots_known(self) -> TemplateOp:
        overlap = set(self.values) & set(self.entity_slots)
        if overlap:
            raise ValueError(f"slots {sorted(overlap)} are both in values and entity_slots")
        for slot, vals in self.values.items():
            if not vals:
                raise ValueError(f"values.{slot}: needs at least one value")
        for slot, kind in self.entity_slots.items():
            if not kind.strip():
                raise ValueError(f"entity_slots.{slot}: give 'capitalized', 'number' or an entity label")
        return self


HEURISTIC_SLOTS = frozenset({"capitalized", "number"})  # TemplateOp.entity_slots kinds that are not labels

Operator = Annotated[SynonymOp | ContextualOp | BackTranslationOp | RestructureOp | TemplateOp,
                     Field(discriminator="type")]


class AugmentConfig(Section):
    enabled: bool = False
    seed: int = 0
    keep_originals: bool = Field(True, description="write the input documents next to their augmentations")
    operators: list[Operator] = Field(default_factory=list)
    device: str = run_setting("cpu", description="torch device for the model-based operators")

    @model_validator(mode="after")
    def _unique_labels(self) -> AugmentConfig:
        seen: set[str] = set()
        for i, op in enumerate(self.operators):
            if op.label in seen:
                raise ValueError(f"operators[{i}]: name {op.label!r} is used twice; give each a unique name")
            seen.add(op.label)
        return self
