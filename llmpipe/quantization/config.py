"""Config section of the quantize stage (and its quality gate)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting


class CalibrationConfig(Section):
    """The calibration sample: packed sequences of our own curated data, never a downloaded set."""

    split: str = Field("train", description="split of the tokenize artifact to sample from")
    samples: int = Field(64, gt=0, description="sequences in the sample (evenly spaced over the split)")
    seq_len: int | None = Field(None, gt=1, description="cut each sequence to this many tokens (None: as packed)")


#: metric names of the evaluate results' "overall" block a gate may name, and whether lower is better
OVERALL_METRICS = {"perplexity": True, "bits_per_byte": True, "loss": True, "accuracy": False}


def parse_allowance(metric: str, value: str | float) -> tuple[float, bool, int]:
    """``(amount, relative, sign)`` of one ``gate.metrics`` entry: ``"+1%"`` (relative: 1% of the fp
    value), ``-1.0`` (absolute: in percentage points for accuracies, the metric's units otherwise);
    ``sign`` is +1 / -1 where written (the direction the metric may move), 0 where not."""
    text = str(value).strip()
    relative = text.endswith("%")
    body = text[:-1].strip() if relative else text
    sign = {"+": 1, "-": -1}.get(body[:1], 0)
    try:
        amount = abs(float(body))
    except ValueError:
        raise ValueError(f"gate.metrics.{metric}: {value!r} is not an allowance like '+1%' or -1.0") from None
    if amount != amount or amount == float("inf"):
        raise ValueError(f"gate.metrics.{metric}: {value!r} is not a finite allowance")
    return amount, relative, sign


class GateConfig(Section):
    """The quantized model may not be worse than the fp model by more than these margins."""

    enabled: bool = True
    max_ppl_increase: float = Field(0.02, description="largest allowed relative perplexity rise (0.02 = 2%)")
    max_accuracy_drop: float = Field(1.0, description="largest allowed fall of each evaluate.tasks file's "
                                                      "accuracy, in percentage points (harness tasks: gate.metrics)")
    metrics: dict[str, str | float] = Field(
        default_factory=dict, description="more checks, metric -> allowed change in its worse direction: "
        "perplexity, bits_per_byte, loss, accuracy (held-out, overall) or <harness task>/<metric>; '+1%' is "
        "relative to the fp value, a number is absolute (percentage points for accuracies), e.g. "
        "{bits_per_byte: +1%, tiny_mc/acc: -1.0}; a change within its standard error is reported as noise")
    verify_bits: bool = Field(True, description="decompress the checkpoint and count values per group")

    @field_validator("metrics")
    @classmethod
    def _allowances(cls, v: dict[str, str | float]) -> dict[str, str | float]:
        for metric, value in v.items():
            if metric not in OVERALL_METRICS and metric.count("/") != 1:
                raise ValueError(f"gate.metrics.{metric}: name one of {sorted(OVERALL_METRICS)} or "
                                 "<harness task>/<metric> (e.g. tiny_mc/acc) or documents/bits_per_byte")
            parse_allowance(metric, value)
        return v

    @field_validator("max_ppl_increase", "max_accuracy_drop")
    @classmethod
    def _non_negative(cls, v: float) -> float:
        if not v >= 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v


class QuantizeConfig(Section):
    """AWQ 4-bit weight-only (compressed-tensors checkpoint) or dynamic int8 for CPU serving."""

    scheme: Literal["awq_w4", "int8_dynamic"] = "awq_w4"
    group_size: int = Field(128, gt=0, description="weights per quantization group; lowered to divide every "
                                                  "quantized layer's input width when it does not (deploy.backend "
                                                  "python); deploy.backend vllm takes 32, 64 or 128 and widths in "
                                                  "multiples of 128, and the stage refuses before any work otherwise")
    symmetric: bool = Field(False, description="False: asymmetric (zero point per group), as AutoAWQ")
    duo_scaling: bool | Literal["both"] = Field(True, description="AWQ scale search uses weights too")
    n_grid: int = Field(20, gt=0, description="AWQ grid points per scale search")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Linear layers kept in full precision")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    device: Literal["auto", "cpu", "cuda"] = run_setting("auto", description="where the quantized model is evaluated")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _grid(self) -> QuantizeConfig:
        # llm-compressor's AWQ grid divides by n_grid - 1 (duo_scaling false), n_grid - 2 (true) or
        # n_grid // 2 - 1 ("both"): below these it fails mid-calibration with ZeroDivisionError
        least = {False: 2, True: 3, "both": 4}[self.duo_scaling]
        if self.n_grid < least:
            raise ValueError(f"n_grid must be >= {least} with duo_scaling {self.duo_scaling!r}, got {self.n_grid}")
        return self
