"""Finding and loading the checkpoint of an upstream artifact (pretrain or quantize)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("llmpipe.evaluation")

WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")


def find_checkpoint(artifact_dir: str | Path) -> Path:
    """The ``save_pretrained`` directory inside an artifact: its root, or a child holding config.json."""
    root = Path(artifact_dir)
    for cand in (root, *(root / n for n in ("model", "hf", "checkpoint", "final", "export"))):
        if (cand / "config.json").is_file():
            return cand
    found = sorted(p.parent for p in root.rglob("config.json") if any(p.parent.glob("*.safetensors")))
    if not found:
        raise FileNotFoundError(f"{root}: no model checkpoint (a directory with config.json and *.safetensors)")
    return found[0]


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(requested)


def load_tokenizer(ckpt: Path) -> Any:
    from transformers import AutoTokenizer

    if not (ckpt / "tokenizer.json").is_file() and not (ckpt / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{ckpt}: the checkpoint holds no tokenizer (tokenizer.json)")
    return AutoTokenizer.from_pretrained(str(ckpt))


def is_compressed_tensors(ckpt: Path) -> bool:
    conf = json.loads((Path(ckpt) / "config.json").read_text())
    return (conf.get("quantization_config") or {}).get("quant_method") == "compressed-tensors"


def load_model(ckpt: Path, device: torch.device) -> Any:
    """A causal LM in eval mode on ``device``.

    A compressed-tensors (AWQ) checkpoint is dequantized at load time (``dequantize=True``): without
    it transformers keeps ``weight_packed`` and decompresses on the first forward, so the Linear
    layers have no ``weight`` to inspect before that. The values are the 4-bit grid either way.
    """
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {}
    if is_compressed_tensors(ckpt):
        from transformers import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype="auto", **kw)
    if device.type == "cpu" and model.dtype in (torch.float16, torch.bfloat16):
        model = model.float()  # half-precision matmuls on CPU are slow and some kernels are missing
    return model.to(device).eval()


def checkpoint_bytes(ckpt: Path) -> int:
    """Bytes of the weight files (what a server has to read), not tokenizer or config files."""
    return sum(f.stat().st_size for g in WEIGHT_GLOBS for f in ckpt.glob(g))
