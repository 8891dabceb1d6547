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
    """A multiple-choice task in a local JSONL file: one ``{"context", "choices", "label"}`` per line,
    scored by lm-evaluation-harness like the built-in ``tiny_mc`` (choices follow the context as written)."""

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


class HarnessConfig(Section):
    """lm-evaluation-harness tasks on the model (llmpipe/evaluation/harness.py); empty ``tasks``: none.

    Every field is in the stage key: the harness's numbers move with batch size, dtype and the
    few-shot sample, so two evaluations compare only under the same settings (results.json holds them).
    """

    tasks: list[str] = Field(default_factory=list, description="built-in task names (tiny_mc, tiny_cloze, "
                             "tiny_docs), folders of task YAMLs (every task in them) or task YAML files")
    num_fewshot: int = Field(0, ge=0, description="examples in each prompt (a task YAML's own 0 wins)")
    fewshot_seed: int = Field(1234, description="seed of the few-shot sample (the harness's default)")
    batch_size: int = Field(8, gt=0, description="requests per forward pass; part of the key: scores move with it")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="cast the model before scoring (auto: as loaded; float32 on CPU)")
    max_length: int | None = Field(None, gt=0, description="tokens per window (None: the model config's)")
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    limit: int | None = Field(None, gt=0, description="score at most this many items per task")
    bootstrap_iters: int = Field(1000, ge=0, description="resamples for standard errors the harness bootstraps "
                                 "(perplexity-type); accuracies have a closed form; 0: none")

    @field_validator("tasks")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        dup = sorted({t for t in v if v.count(t) > 1})
        if dup:
            raise ValueError(f"tasks named twice: {dup}")
        return v


class EvaluateConfig(Section):
    """Perplexity / bits-per-byte / next-token accuracy on held-out data, greedy samples, MC tasks."""

    split: str = Field("val", description="split of the tokenize artifact to evaluate on")
    max_sequences: int | None = Field(256, gt=0, description="evaluate at most this many packed sequences")
    prompts: list[str] = Field(default_factory=lambda: ["The ", "Once upon a time"],
                               description="greedy generations shown in the report")
    max_new_tokens: int = Field(32, gt=0, le=4096)
    tasks: list[TaskConfig] = Field(default_factory=list)
    documents: int = Field(16, ge=0, description="whole held-out documents scored in rolling windows "
                           "(document-level bits per byte; evenly spaced over the split); 0: none")
    doc_window: int | None = Field(None, ge=2, description="tokens per rolling window (None: the model's maximum)")
    doc_stride: int | None = Field(None, ge=1, description="new tokens each later window predicts (None: "
                                   "window - 1, the harness's disjoint windows); smaller: more context, more cost")
    kn_order: int = Field(3, ge=1, le=6, description="order of the interpolated Kneser-Ney baseline over token ids")
    kn_max_train_tokens: int | None = Field(500_000, gt=0, description="train tokens the KN baseline is "
                                            "estimated from (every k-th document; pure Python: ~20 s and ~0.5 GB per 10^6 tokens); None: all")
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    batch_size: int = run_setting(8, gt=0, description="sequences per forward pass")
    device: Literal["auto", "cpu", "cuda"] = run_setting("auto")
