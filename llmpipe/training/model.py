"""The model: a Llama-style decoder from ``transformers``, built from a preset or an HF checkpoint.

Presets are ``LlamaConfig`` keyword sets; ``train.model.overrides`` changes any field. The vocabulary
size and the bos / eos / pad ids always come from the tokenizer artifact, so the embedding matches the
token ids on disk and generation stops at the tokenizer's end-of-text. Training runs without the KV
cache (``use_cache: false``); the exported model (:func:`ready_for_inference`) turns it on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PRESETS: dict[str, dict[str, Any]] = {
    # CPU seconds: used by tests and configs/tiny.yaml. Head size 32 and widths in multiples of 32 are what
    # vLLM's CPU kernels take (its CPU attention refuses head_dim 16; its W4A16 kernel, CPUWNA16, input
    # widths off multiples of 32), so the tiny model also serves on vLLM's CPU build
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=512),
    # GPT-2-small sized Llama (~125M with a 32k vocab)
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, max_position_embeddings=2048),
    # TinyLlama-like 1.1B shape
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, max_position_embeddings=2048),
}

log = logging.getLogger("llmpipe.training")


def llama_config(preset: str, vocab_size: int, overrides: dict[str, Any] | None = None,
                 token_ids: dict[str, int | None] | None = None) -> Any:
    """The ``LlamaConfig`` of a preset with the tokenizer's vocabulary and special ids (``token_ids``:
    :func:`tokenizer_token_ids`) and the user's overrides."""
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise ValueError(f"train.model.preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    kw = dict(PRESETS[preset], vocab_size=int(vocab_size), tie_word_embeddings=False,
              rms_norm_eps=1e-5, initializer_range=0.02, use_cache=False, **(token_ids or {}))
    for k in overrides or {}:
        if not hasattr(LlamaConfig(), k):
            raise ValueError(f"train.model.overrides.{k}: not a LlamaConfig field")
    kw.update(overrides or {})
    return LlamaConfig(**kw)


def tokenizer_token_ids(tokenizer_dir: str | Path) -> dict[str, int | None]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a tokenizer artifact, from the ids its stage
    recorded (``llmpipe_tokenizer.json``): the names ``LlamaConfig`` and ``GenerationConfig`` take."""
    from llmpipe.tokenization.layout import TOKENIZER

    meta_path = Path(tokenizer_dir) / TOKENIZER.meta
    if not meta_path.is_file():
        raise FileNotFoundError(f"train: tokenizer artifact {tokenizer_dir} has no {TOKENIZER.meta} "
                                "(the special ids the model is built with)")
    meta = json.loads(meta_path.read_text())
    return {f"{k}_token_id": meta.get(f"{k}_id") for k in ("bos", "eos", "pad")}


def ready_for_inference(model: Any, token_ids: dict[str, int | None] | None) -> None:
    """Configure a model for export in place: the tokenizer's special ids in ``config.json`` and
    ``generation_config.json`` (generation stops at the tokenizer's end-of-text, pads with its pad),
    and ``use_cache: true`` (training ran without the KV cache; every ``generate`` after it wants it)."""
    from transformers import GenerationConfig

    for k, v in (token_ids or {}).items():
        setattr(model.config, k, v)
    model.config.use_cache = True
    c = model.config
    model.generation_config = GenerationConfig(bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                                               pad_token_id=c.pad_token_id)


def max_positions(preset: str, overrides: dict[str, Any] | None = None) -> int:
    return int((overrides or {}).get("max_position_embeddings", PRESETS[preset]["max_position_embeddings"]))


def choose_attention(requested: str, device: torch.device) -> str:
    """``flash_attention_2`` on CUDA when flash-attn imports, else ``sdpa``.

    ``transformers`` raises instead of falling back when flash-attn is missing, so the choice is
    made here explicitly and logged by the caller.
    """
    has_fa = importlib.util.find_spec("flash_attn") is not None
    if requested == "auto":
        return "flash_attention_2" if device.type == "cuda" and has_fa else "sdpa"
    if requested == "flash_attention_2" and not (device.type == "cuda" and has_fa):
        raise ValueError("train.model.attention: flash_attention_2 needs CUDA and the flash-attn package; "
                         "use 'auto' to fall back to sdpa")
    return requested


def build_model(cfg: Any, vocab_size: int, device: torch.device, dtype: torch.dtype = torch.float32,
                token_ids: dict[str, int | None] | None = None, meta: bool = False) -> Any:
    """A seeded fresh model or one continued from ``cfg.model.init_from``; attention chosen for the device;
    the tokenizer's special ids (``token_ids``) in its config. ``meta``: a fresh model's parameters on the
    meta device (no memory, no values): the sharded engines shard it, then :func:`materialize` it."""
    from transformers import AutoModelForCausalLM

    attn = choose_attention(cfg.model.attention, device)
    if cfg.model.init_from:
        model = AutoModelForCausalLM.from_pretrained(cfg.model.init_from, attn_implementation=attn,
                                                     dtype=dtype)
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"train.model.init_from: checkpoint vocab {model.config.vocab_size} is smaller "
                             f"than the tokenizer's {vocab_size}")
    else:
        conf = llama_config(cfg.model.preset, vocab_size, cfg.model.overrides, token_ids)
        torch.manual_seed(cfg.seed)
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(conf, attn_implementation=attn).to(dtype)
    for k, v in (token_ids or {}).items():  # a checkpoint continued with this tokenizer takes its ids
        setattr(model.config, k, v)
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode, where HF layers skip gradient checkpointing
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, attn


def _preorder(m: torch.nn.Module) -> Iterator[torch.nn.Module]:
    yield m
    for c in m.children():
        yield from _preorder(c)


def _postorder(m: torch.nn.Module) -> Iterator[torch.nn.Module]:
    for c in m.children():
        yield from _postorder(c)
    yield m


def _set(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Write a full tensor into a parameter: whole, or this rank's shard of it (a DTensor, FSDP2 or
    tensor parallel: the same chunking as ``distribute_tensor``, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def _construction_draws(module: torch.nn.Module) -> None:
    """The random numbers ``torch.nn``'s own constructors draw for ``module`` (``reset_parameters``),
    drawn into a scratch tensor and dropped: HF's init then overwrites them, but they move the stream."""
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.kaiming_uniform_(torch.empty(module.weight.shape), a=math.sqrt(5))
        if module.bias is not None:
            bound = 1 / math.sqrt(module.in_features)
            torch.nn.init.uniform_(torch.empty(module.bias.shape), -bound, bound)
    elif isinstance(module, torch.nn.Embedding):
        torch.nn.init.normal_(torch.empty(module.weight.shape))


def _hf_init(module: torch.nn.Module, std: float) -> None:
    """What transformers' init gives a Llama module (normal(0, initializer_range) matrices, a zero
    padding row and biases, unit norms), written one parameter at a time."""
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        full = torch.empty(module.weight.shape).normal_(0.0, std)
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            full[module.padding_idx] = 0
        _set(module.weight, full)
        if getattr(module, "bias", None) is not None:
            _set(module.bias, torch.zeros(module.bias.shape))
    elif "RMSNorm" in type(module).__name__:
        _set(module.weight, torch.ones(module.weight.shape))


@torch.no_grad()
def materialize(model: Any, device: torch.device, seed: int) -> None:
    """Give a model built on the meta device (``build_model(meta=True)``), already sharded, its memory on
    ``device`` and the weights the eager build gives for ``seed``, one full parameter at a time (the
    largest: the embedding), so no rank ever holds the whole unsharded model (torchtitan's meta init).

    The eager build draws, in order: the base model's ``torch.nn`` constructor inits, its HF init
    (``post_init`` of ``LlamaModel``, modules children first), then the LM head's constructor init and
    HF init. The same draws are replayed here from the same seed; HF's own ``init_weights()`` on the
    sharded model draws each shard through DTensor's random ops, and its weights differ from the eager
    build's (measured on 2 CPU ranks).
    The test holds this to the eager build's full state dict, bit for bit.
    """
    model.to_empty(device=device)
    std = model.config.initializer_range
    torch.manual_seed(seed)
    for part in (model.model, model.lm_head):
        for m in _preorder(part):
            _construction_draws(m)
        for m in _postorder(part):
            _hf_init(m, std)
    for m in model.modules():  # the rotary tables: computed, not drawn; rebuilt on the device
        if "RotaryEmbedding" in type(m).__name__:
            fresh = type(m)(config=model.config)
            for name, buf in fresh.named_buffers():
                m.get_buffer(name).copy_(buf)


def flops_per_token(model_config: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params + attention (PaLM appendix B accounting)."""
    h = model_config.hidden_size
    n_layers = model_config.num_hidden_layers
    inter = model_config.intermediate_size
    kv = model_config.num_key_value_heads * (h // model_config.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q,o + k,v + gate,up,down
    params = n_layers * per_layer + h * model_config.vocab_size  # + lm head (a matmul per token)
    return 6.0 * params + 12.0 * n_layers * h * seq_len


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# peak dense bf16 FLOP/s (no sparsity) by the exact name torch.cuda.get_device_properties reports: an
# H100 PCIe is not an SXM part, nor an H200 NVL an H200 SXM. Another name: train.launch.peak_tflops.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA L40S": 362e12, "NVIDIA A10G": 125e12, "NVIDIA L4": 121e12,
}


def device_peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of the GPU (``override_tflops``: train.launch.peak_tflops), or None on
    CPU and for a GPU the table does not name exactly (MFU then reports achieved FLOP/s only)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_properties(device).name
    if name not in PEAK_FLOPS:
        log.warning("no peak FLOP/s known for %r: MFU is not reported; set train.launch.peak_tflops", name)
    return PEAK_FLOPS.get(name)
