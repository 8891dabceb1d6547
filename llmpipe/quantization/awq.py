"""AWQ 4-bit weight-only quantization with llmcompressor, calibrated on our own data.

``AWQModifier`` searches per-channel scales that protect the weights that meet large activations,
then ``QuantizationModifier`` rounds every targeted Linear to 4-bit groups. The result is saved as a
compressed-tensors ``pack-quantized`` checkpoint: plain ``transformers`` loads (and decompresses)
it, and vLLM / Triton's vLLM backend load it natively.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmpipe.quantization.config import QuantizeConfig

log = logging.getLogger("llmpipe.quantization")


def quantized_linears(model: torch.nn.Module, ignore: list[str]) -> dict[str, torch.nn.Linear]:
    """The Linear layers a weight-only scheme quantizes: all but those whose name ends in an ignore entry."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and not any(n == i or n.endswith("." + i) for i in ignore)}


def effective_group_size(model: torch.nn.Module, group_size: int, ignore: list[str]) -> int:
    """The largest power of two <= ``group_size`` that divides every quantized layer's input width.

    The tiny preset's layers are 64 and 192 wide, so 128 becomes 64: a group size vLLM's CPU W4A16
    kernel (CPUWNA16: even groups, widths in multiples of 32) serves, as the Python backend does. For
    ``deploy.backend: vllm`` on GPU (Marlin) the stage has refused a model whose widths need lowering
    before this runs (``llmpipe/quantization/readiness.py``), so there the group size is never lowered.
    """
    widths = {m.in_features for m in quantized_linears(model, ignore).values()}
    if not widths:
        raise ValueError("quantize: the model has no Linear layer left to quantize (check quantize.ignore)")
    g = group_size
    while g > 1 and any(w % g for w in widths):
        g //= 2
    return g


@contextlib.contextmanager
def cpu_calibration_fix() -> Iterator[bool]:
    """Make llmcompressor's AWQ run on a machine with no accelerator; yields whether it patched.

    llmcompressor 0.14 pins cached activations (``IntermediatesCache.pin_memory``) to speed up
    host-to-device copies during the AWQ grid search. With no accelerator there is no device to
    copy to and ``Tensor.pin_memory()`` raises "Cannot access accelerator device when none is
    available". Pinning never changes values, so skipping it is exact. The patch is applied only
    when no accelerator is present and only for the duration of the block.
    """
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield False
        return
    original = IntermediatesCache.pin_memory

    def _no_pin(self: Any, batch_index: int, input_names: list[str] | None = None) -> None:
        return None

    IntermediatesCache.pin_memory = _no_pin  # type: ignore[method-assign]
    try:
        yield True
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]


def calibration_dataset(sequences: list[np.ndarray], pad_id: int | None) -> Any:
    """A ``datasets.Dataset`` of input_ids / attention_mask (padding removed) for ``oneshot``."""
    from datasets import Dataset

    rows = []
    for s in sequences:
        s = np.asarray(s, dtype=np.int64)
        if pad_id is not None:
            s = s[s != pad_id]
        if len(s) > 1:
            rows.append(s.tolist())
    if not rows:
        raise ValueError("quantize.calibration: the calibration sample holds no tokens")
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})


def recipe(cfg: QuantizeConfig, group_size: int, awq: bool = True) -> list[Any]:
    """AWQ scale search + W4 group quantization; ``awq=False`` is plain round-to-nearest (the baseline)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=cfg.symmetric, strategy="group",
                               group_size=group_size)
    smooth = [AWQModifier(duo_scaling=cfg.duo_scaling, n_grid=cfg.n_grid)] if awq else []
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    return [*smooth, QuantizationModifier(config_groups=groups, ignore=list(cfg.ignore))]


def awq_quantize(fp_dir: Path, out_dir: Path, cfg: QuantizeConfig, calib: Any, awq: bool = True) -> dict[str, Any]:
    """Quantize the checkpoint at ``fp_dir`` and save the compressed checkpoint (and tokenizer) to ``out_dir``."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmpipe.tokenization.tokenizer import save_loaded

    tok = AutoTokenizer.from_pretrained(str(fp_dir))
    # oneshot re-reads the config from model.config.name_or_path, so the model must come from disk
    model = AutoModelForCausalLM.from_pretrained(str(fp_dir), dtype=torch.float32)
    group = effective_group_size(model, cfg.group_size, cfg.ignore)
    if group != cfg.group_size:
        log.info("quantize: group size %d does not divide every layer width; using %d", cfg.group_size, group)
    max_len = max(len(r) for r in calib["input_ids"])
    t0 = time.perf_counter()
    with cpu_calibration_fix() as patched:
        model = oneshot(model=model, tokenizer=tok, dataset=calib, recipe=recipe(cfg, group, awq),
                        num_calibration_samples=len(calib), max_seq_length=max_len,
                        shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), save_compressed=True)
    save_loaded(tok, out_dir)
    return {"group_size": group, "bits": 4, "symmetric": cfg.symmetric, "quantize_seconds": round(seconds, 3),
            "cpu_pin_memory_fix": patched, "calibration_sequences": len(calib),
            "calibration_tokens": int(sum(len(r) for r in calib["input_ids"]))}


def distinct_values_per_group(model: torch.nn.Module, group_size: int, ignore: list[str]) -> dict[str, int]:
    """Most distinct weight values in any group of each quantized layer (<= 16 for real 4-bit weights)."""
    out = {}
    for name, lin in quantized_linears(model, ignore).items():
        w = lin.weight.detach().float().cpu()
        groups = w.reshape(w.shape[0], -1, group_size).reshape(-1, group_size)
        s = groups.sort(dim=-1).values
        out[name] = int(((s[:, 1:] != s[:, :-1]).sum(dim=-1) + 1).max())
    return out


def rtn_quantize_(model: torch.nn.Module, group_size: int, bits: int = 4, symmetric: bool = False,
                  ignore: list[str] | None = None) -> None:
    """Plain round-to-nearest fake quantization in place (the baseline AWQ must beat).

    Same grid as compressed-tensors' asymmetric min-max groups: scale = (max - min) / (2^bits - 1)
    over each group with 0 always representable, zero point rounded.
    """
    qmax = 2**bits - 1
    for lin in quantized_linears(model, ignore or ["lm_head"]).values():
        w = lin.weight.data
        g = w.float().reshape(w.shape[0], -1, group_size)
        if symmetric:
            scale = (g.abs().amax(-1, keepdim=True) / (qmax / 2)).clamp(min=1e-8)
            q = (g / scale).round().clamp(-(qmax + 1) // 2, qmax // 2)
            deq = q * scale
        else:
            lo = g.amin(-1, keepdim=True).clamp(max=0)
            hi = g.amax(-1, keepdim=True).clamp(min=0)
            scale = ((hi - lo) / qmax).clamp(min=1e-8)
            zp = (-lo / scale).round().clamp(0, qmax)
            deq = ((g / scale).round() + zp).clamp(0, qmax).sub(zp).mul(scale)
        w.copy_(deq.reshape_as(w).to(w.dtype))
