"""Finding and loading the checkpoint of an upstream artifact (pretrain or quantize)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("llmpipe.evaluation")

WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")
HF_CONFIG = "config.json"  # save_pretrained's model config: marks a checkpoint folder


def find_checkpoint(artifact_dir: str | Path) -> Path:
    """The ``save_pretrained`` directory of a model artifact, where its producer's layout declares it.

    The one lookup evaluate, quantize and deploy share: a pretrain artifact holds its checkpoint at
    ``PRETRAIN.checkpoint`` (the root), a quantize artifact at ``QUANTIZE.checkpoint``. No guessing
    of other folder names: a stage that moves its checkpoint changes its layout, and every consumer
    follows.
    """
    from llmpipe.quantization.layout import QUANTIZE
    from llmpipe.training.layout import PRETRAIN

    root = Path(artifact_dir)
    places = {"pretrain": PRETRAIN.checkpoint, "quantize": QUANTIZE.checkpoint}
    for sub in places.values():
        if (root / sub / HF_CONFIG).is_file():
            return root / sub
    where = ", ".join(f"{name}: {sub}/{HF_CONFIG}" for name, sub in places.items())
    raise FileNotFoundError(f"{root}: no HF checkpoint where a model stage puts it ({where})")


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(requested)


def load_tokenizer(ckpt: Path) -> Any:
    from transformers import AutoTokenizer

    from llmpipe.tokenization.layout import TOKENIZER

    if not (ckpt / TOKENIZER.tokenizer).is_file() and not (ckpt / TOKENIZER.config).is_file():
        raise FileNotFoundError(f"{ckpt}: the checkpoint holds no tokenizer ({TOKENIZER.tokenizer})")
    return AutoTokenizer.from_pretrained(str(ckpt))


def is_compressed_tensors(ckpt: Path) -> bool:
    conf = json.loads((Path(ckpt) / HF_CONFIG).read_text())
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
