"""Config section of the evaluate stage.

The quantize stage's quality gate re-runs the same evaluation on the quantized model, so every field
that changes a number here is part of the key; only the batch size and the device are run settings
(they change speed, not results beyond float noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from llmpipe.config_base import Section, run_setting


class TaskConfig(Section):
    """A multiple-choice task in a local JSONL file: one ``{"context", "choices", "label"}`` per line."""

    name: str = Field(..., min_length=1, description="short name shown in the results table")
    path: str = Field(..., description="JSONL file; relative paths are taken from the working directory")
    limit: int | None = Field(None, gt=0, description="score at most this many examples")

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError(f"must use letters, digits, '-', '_' or '.', got {v!r}")
        return v

    def resolved(self) -> Path:
        return Path(self.path).expanduser()


class EvaluateConfig(Section):
    """Perplexity / bits-per-byte / next-token accuracy on held-out data, greedy samples, MC tasks."""

    split: str = Field("val", description="split of the tokenize artifact to evaluate on")
    max_sequences: int | None = Field(256, gt=0, description="evaluate at most this many packed sequences")
    prompts: list[str] = Field(default_factory=lambda: ["The ", "Once upon a time"],
                               description="greedy generations shown in the report")
    max_new_tokens: int = Field(32, gt=0, le=4096)
    tasks: list[TaskConfig] = Field(default_factory=list)
    batch_size: int = run_setting(8, gt=0, description="sequences per forward pass")
    device: Literal["auto", "cpu", "cuda"] = run_setting("auto")
