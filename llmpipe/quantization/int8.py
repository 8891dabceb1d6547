"""Dynamic int8 quantization of Linear layers (``torch.ao``) for CPU serving.

Weights become int8 per tensor at load time and activations are quantized on the fly per batch, so
there is no calibration and the result is a pure function of the fp weights: the artifact stores
the fp checkpoint plus a marker file, and :func:`load_for_serving` re-applies the same
transformation. ``torch.ao`` dynamic quantization runs on x86/ARM CPUs only.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from llmpipe.quantization.awq import quantized_linears

MARKER = "llmpipe_quantization.json"


def quantize_int8_dynamic(model: torch.nn.Module, ignore: list[str]) -> torch.nn.Module:
    """A copy of ``model`` on CPU whose quantized Linear layers are ``DynamicQuantizedLinear``."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    spec = {name: default_dynamic_qconfig for name in quantized_linears(model, ignore)}
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated upstream but still the CPU path
        warnings.simplefilter("ignore")
        return quantize_dynamic(model.cpu(), spec, dtype=torch.qint8, inplace=False)


def serialized_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``torch.save(state_dict)``: what the int8 model takes on disk."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


def write_marker(ckpt: Path, info: dict[str, Any]) -> None:
    (ckpt / MARKER).write_text(json.dumps(info, indent=1, sort_keys=True))


def load_for_serving(ckpt: str | Path) -> Any:
    """The model a CPU server should run: int8-dynamic when the checkpoint's marker says so, else the
    checkpoint as transformers loads it (AWQ checkpoints are decompressed on load)."""
    from transformers import AutoModelForCausalLM

    ckpt = Path(ckpt)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    marker = ckpt / MARKER
    if marker.is_file():
        info = json.loads(marker.read_text())
        if info.get("scheme") == "int8_dynamic":
            return quantize_int8_dynamic(model, list(info.get("ignore", ["lm_head"]))).eval()
    return model
