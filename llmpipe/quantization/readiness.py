"""Serving readiness: will the quantized checkpoint serve on the kernels of the deploy target?

Checked by the quantize stage before any work (and by the deploy stage on the checkpoint it is
given), so that a release fails in seconds with the config key to change, instead of after
calibration with an artifact the server cannot load.

- ``deploy.backend: python`` (CPU or GPU): ``transformers`` decompresses the compressed-tensors
  checkpoint to dense weights, so any group size that divides the layer widths serves; the AWQ
  step lowers ``quantize.group_size`` until it does (a 176-wide MLP takes 16; the tiny preset's 64 and 192 take 64).
- ``deploy.backend: vllm``: vLLM runs W4A16 (4-bit weights, 16-bit activations) on Marlin, the
  kernel it picks for compressed-tensors group quantization on Ampere and newer GPUs. Marlin takes
  group sizes 32, 64 and 128, and tiles each weight in 128 input by 64 output columns
  (``MARLIN_SUPPORTED_GROUP_SIZES``, ``GPTQ_MARLIN_MIN_THREAD_K`` / ``_N`` in vLLM's
  ``marlin_utils.py``). A lowered group size or a width off those tiles would not serve, so
  nothing is lowered: the stage refuses and says what to change. Dynamic int8 is torch's CPU
  quantization, which vLLM does not read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmpipe.quantization.config import QuantizeConfig
from llmpipe.serving.config import DeployConfig

MARLIN_GROUP_SIZES = (32, 64, 128)
MARLIN_TILE_IN = 128  # input features of one Marlin tile (the reduction dimension)
MARLIN_TILE_OUT = 64  # output features of one Marlin tile
SHOWN = 4  # layers named in the message (a model repeats the same shapes in every block)


class ServingReadinessError(ValueError):
    """The quantized model would not serve on the deploy target; the message says which keys to change."""


def serving_problems(shapes: Mapping[str, tuple[int, int]], scheme: str, group_size: int,
                     deploy: DeployConfig) -> list[str]:
    """What stops a ``scheme`` checkpoint with ``group_size`` groups and these quantized Linear shapes
    (name -> (in_features, out_features)) from serving with ``deploy``; empty when nothing does."""
    if deploy.backend != "vllm":
        return []  # the Python backend dequantizes with transformers: no kernel shape constraint
    if scheme != "awq_w4":
        return [f"quantize.scheme {scheme!r} is torch's dynamic int8 for CPU serving, which vLLM does not "
                "read: set quantize.scheme: awq_w4 (or deploy.backend: python)"]
    problems = []
    if group_size not in MARLIN_GROUP_SIZES:
        problems.append(f"quantize.group_size {group_size}: vLLM's W4A16 (Marlin) kernels take group sizes "
                        f"{', '.join(map(str, MARLIN_GROUP_SIZES))}: set quantize.group_size: 128")
    bad = {n: s for n, s in shapes.items() if s[0] % MARLIN_TILE_IN or s[1] % MARLIN_TILE_OUT}
    if bad:
        shown = ", ".join(f"{n} ({i} -> {o})" for n, (i, o) in list(bad.items())[:SHOWN])
        more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        problems.append(
            f"{len(bad)} of {len(shapes)} quantized Linear layers have widths vLLM's W4A16 (Marlin) kernels "
            f"cannot take (input a multiple of {MARLIN_TILE_IN}, output of {MARLIN_TILE_OUT}): {shown}{more}; "
            "make the model's widths multiples of 128 (train.model.preset, or train.model.overrides "
            "hidden_size / intermediate_size / num_attention_heads), or keep those layers in full precision "
            "with quantize.ignore")
    return problems


def linear_shapes(checkpoint: Path, ignore: list[str]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear a weight-only scheme quantizes, from the checkpoint's config
    alone: the model is built on the meta device, so no weight is read or allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmpipe.quantization.awq import quantized_linears

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(checkpoint)))
    return {n: (m.in_features, m.out_features) for n, m in quantized_linears(model, ignore).items()}


def check_before_quantizing(fp_dir: Path, cfg: QuantizeConfig, deploy: DeployConfig) -> None:
    """Raise :class:`ServingReadinessError` when quantizing ``fp_dir`` with ``cfg`` would give a
    checkpoint ``deploy`` cannot serve. Costs nothing for the Python backend (nothing to check)."""
    if deploy.backend != "vllm":
        return
    shapes = linear_shapes(fp_dir, cfg.ignore) if cfg.scheme == "awq_w4" else {}
    _raise(serving_problems(shapes, cfg.scheme, cfg.group_size, deploy), deploy, "quantize")


def check_checkpoint(checkpoint: Path, deploy: DeployConfig) -> None:
    """The same check on a quantized checkpoint (the deploy stage's input), from what its files say:
    a cached quantize artifact made for the Python backend may have a lowered group size."""
    if deploy.backend != "vllm":
        return
    scheme, group, ignore = checkpoint_quantization(Path(checkpoint))
    if scheme is None:
        return  # a full-precision checkpoint: vLLM serves it without quantized kernels
    shapes = linear_shapes(checkpoint, ignore) if scheme == "awq_w4" else {}
    _raise(serving_problems(shapes, scheme, group or 0, deploy), deploy, f"deploy: {checkpoint}")


def checkpoint_quantization(checkpoint: Path) -> tuple[str | None, int | None, list[str]]:
    """(scheme, group size, ignored layers) recorded in a checkpoint: compressed-tensors group
    quantization in config.json, or llmpipe's int8 marker; (None, None, []) for a plain checkpoint."""
    from llmpipe.quantization.int8 import MARKER

    if (checkpoint / MARKER).is_file():
        return "int8_dynamic", None, []
    config: dict[str, Any] = json.loads((checkpoint / "config.json").read_text())
    qcfg = config.get("quantization_config") or {}
    groups = list((qcfg.get("config_groups") or {}).values())
    if not groups:
        return None, None, []
    weights = groups[0].get("weights") or {}
    return "awq_w4", weights.get("group_size"), list(qcfg.get("ignore") or [])


def _raise(problems: list[str], deploy: DeployConfig, where: str) -> None:
    if problems:
        raise ServingReadinessError(f"{where}: the quantized model would not serve with deploy.backend "
                                    f"{deploy.backend!r} (target {deploy.target}): " + "; ".join(problems))
