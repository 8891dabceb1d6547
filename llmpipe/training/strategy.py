"""``train.strategy: auto``: which parallelism a model needs, from its size and the devices' memory.

The field guides' table, made concrete with a memory estimate per device:

| parameters | strategy |
| --- | --- |
| under 10B | data parallel: DDP when a full replica fits on one device, else FSDP2 (sharded data parallel) |
| 10B to 100B | ZeRO-2 when its shards fit, else tensor parallel inside a node x pipeline parallel across |
| over 100B | 3D: tensor x pipeline x data parallel |

The estimate (bytes per device) follows the ZeRO paper's accounting of mixed-precision Adam:
16-bit weights and gradients (2 + 2 bytes per parameter) plus fp32 master weights, momentum and
variance (12 bytes), or 4 + 4 + 8 in fp32. Activations are what the forward pass keeps for the
backward pass of one micro-batch, counted per token of a Llama decoder layer (hidden h, key/value
width kv, MLP width i, a heads, sequence s): ``4·(8h + 2kv + 4i)`` bytes in fp32 and
``34h + 8kv + 14i`` under bf16/fp16 autocast (the residual stream and the RMSNorms stay fp32),
plus the attention scores only where the attention materialises them (``eager``: ``4·a·s`` or
``6·a·s`` bytes; SDPA and flash attention keep none: Korthikanti et al.'s ``5·a·s/h`` term does
not apply to them), plus the head (the logits, ``4·V`` or ``2·V`` bytes: the trainer's chunked
cross-entropy keeps no fp32 log-softmax of the whole vocabulary; and about ``12h``). With activation checkpointing each layer keeps its fp32 input (``4h``) and one layer
is recomputed at a time. The coefficients are counted, not guessed:
``tests/unit/training/test_training_strategy.py`` measures every tensor autograd saves for
backward of tiny models on the CPU and holds the estimate to 20% of it. The planner is a pure
function: ``choose`` is tested on the table's rows (125M, 13B, 175B on 8 x 80 GB) without any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

GB = 1 << 30
HEADROOM = 0.9  # plan for 90% of a device's memory: allocator fragmentation, buffers, CUDA context


@dataclass(frozen=True)
class Devices:
    """The devices a job runs on: ``count`` in all, ``per_node`` on each node, ``memory`` bytes each."""

    count: int
    per_node: int
    memory: int
    kind: Literal["cuda", "cpu"] = "cuda"

    def __post_init__(self) -> None:
        if self.count < 1 or self.per_node < 1 or self.memory <= 0:
            raise ValueError(f"devices must be positive, got count={self.count} per_node={self.per_node} "
                             f"memory={self.memory}")


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of the model: its parameter count and the shape of one layer."""

    parameters: int
    layers: int
    hidden: int
    heads: int
    kv_width: int = 0  # keys' (and values') width per token: 0 = hidden (no grouped-query attention)
    intermediate: int = 0  # the MLP's width: 0 = 4 x hidden
    vocab: int = 0

    @classmethod
    def of_llama(cls, config: Any) -> ModelShape:
        """From a ``LlamaConfig`` (or anything with its fields), without building the model."""
        h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        kv = config.num_key_value_heads * (h // config.num_attention_heads)
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h  # q, o; k, v; gate, up, down; norms
        embeddings = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
        return cls(layers * per_layer + embeddings + h, layers, h, config.num_attention_heads, kv, inter,
                   config.vocab_size)


@dataclass(frozen=True)
class Memory:
    """Bytes per device of one plan."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        parts = [f"{name} {getattr(self, name) / GB:.2f}" for name in
                 ("parameters", "gradients", "optimizer", "activations")]
        return f"{self.total / GB:.2f} GiB per device ({', '.join(parts)})"


@dataclass(frozen=True)
class Plan:
    """The choice: a strategy llmpipe runs, its ZeRO stage, the 3 parallel degrees, and why."""

    strategy: Literal["ddp", "fsdp2", "deepspeed"]
    zero_stage: int | None
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    memory: Memory
    fits: bool
    reason: str

    def describe(self) -> str:
        zero = f" ZeRO-{self.zero_stage}" if self.zero_stage is not None else ""
        degrees = f"tp={self.tensor_parallel} pp={self.pipeline_parallel} dp={self.data_parallel}"
        verdict = "fits" if self.fits else "does NOT fit"
        return f"{self.strategy}{zero} ({degrees}): {self.reason}; {self.memory.describe()} {verdict}"


def state_bytes(parameters: int, precision: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) in bytes for Adam: 16 bytes per parameter either way."""
    if precision == "fp32":
        return 4 * parameters, 4 * parameters, 8 * parameters
    return 2 * parameters, 2 * parameters, 12 * parameters  # bf16/fp16 + fp32 master, m, v


def activation_bytes(shape: ModelShape, seq_len: int, micro_batch: int, precision: str,
                     checkpointing: bool, attention: str = "sdpa") -> int:
    """Bytes one micro-batch keeps for its backward pass on one device (no tensor parallel), for the
    attention implementation that runs (see the module docstring for the counts)."""
    s, h, a = seq_len, shape.hidden, shape.heads
    kv, inter = shape.kv_width or h, shape.intermediate or 4 * h
    if precision == "fp32":
        layer, scores, head = 4 * (8 * h + 2 * kv + 4 * inter), 4 * a * s, 4 * shape.vocab + 12 * h
    else:
        layer, scores, head = 34 * h + 8 * kv + 14 * inter, 6 * a * s, 2 * shape.vocab + 12 * h
    if attention == "eager":  # the softmax's probabilities, a x s per token: the s^2 term
        layer += scores
    kept = shape.layers * 4 * h + layer if checkpointing else shape.layers * layer
    return (kept + head) * s * micro_batch


def choose(shape: ModelShape, devices: Devices, *, seq_len: int, micro_batch: int,
           precision: str = "bf16", checkpointing: bool = False, attention: str = "sdpa") -> Plan:
    """The table's answer for this model on these devices, with the memory estimate behind it."""
    budget = HEADROOM * devices.memory
    weights, grads, optim = state_bytes(shape.parameters, precision)
    act = activation_bytes(shape, seq_len, micro_batch, precision, checkpointing, attention)
    n = devices.count

    if shape.parameters < 10e9:
        replica = Memory(weights, grads, optim, act)
        if replica.total <= budget:
            return Plan("ddp", None, 1, 1, n, replica, True, "under 10B parameters and a replica fits: DDP")
        sharded = Memory(weights // n, grads // n, optim // n, act)
        return Plan("fsdp2", None, 1, 1, n, sharded, sharded.total <= budget,
                    "under 10B parameters, a replica does not fit: FSDP2 shards it over the data-parallel ranks")
    if shape.parameters <= 100e9:
        zero2 = Memory(weights, grads // n, optim // n, act)
        if zero2.total <= budget:
            return Plan("deepspeed", 2, 1, 1, n, zero2, True,
                        "10B-100B parameters and ZeRO-2's shards fit: ZeRO-2")
        return _model_parallel(shape, devices, budget, (weights, grads, optim), act, 1,
                               "10B-100B parameters, ZeRO-2 does not fit: tensor x pipeline parallel")
    return _model_parallel(shape, devices, budget, (weights, grads, optim), act, 2,
                           "over 100B parameters: 3D parallelism (tensor x pipeline x data)")


def estimate(shape: ModelShape, devices: Devices, strategy: str, *, seq_len: int, micro_batch: int,
             precision: str = "bf16", checkpointing: bool = False, attention: str = "sdpa",
             zero_stage: int | None = None) -> Memory:
    """Bytes per device of a data-parallel strategy a config names (``choose`` picks one itself):
    DDP a whole replica, FSDP2 (and ZeRO-3) every state sharded, ZeRO-1 the optimizer, ZeRO-2 the
    optimizer and gradients. What a measured peak is held against (``benchmarks/gpu``)."""
    weights, grads, optim = state_bytes(shape.parameters, precision)
    act = activation_bytes(shape, seq_len, micro_batch, precision, checkpointing, attention)
    n = devices.count
    sharded = {"ddp": 0, "fsdp2": 3, "deepspeed": zero_stage or 1}[strategy]
    return Memory(weights // n if sharded >= 3 else weights, grads // n if sharded >= 2 else grads,
                  optim // n if sharded >= 1 else optim, act)


def _model_parallel(shape: ModelShape, devices: Devices, budget: float, state: tuple[int, int, int],
                    act: int, min_pp: int, reason: str) -> Plan:
    """Tensor parallel inside a node (up to 8, dividing the heads), then the fewest pipeline stages
    that fit, the devices left over data parallel with FSDP2 sharding the state over them (as
    torchtitan composes them). Reports ``fits=False`` and about how many devices it would take when
    every device of the job is not enough."""
    tp = max(d for d in (8, 4, 2, 1) if d <= devices.per_node and shape.heads % d == 0)
    most = min(devices.count // tp, shape.layers)
    stages = [pp for pp in range(min(min_pp, most), most + 1)
              if (devices.count // tp) % pp == 0 and shape.layers % pp == 0]  # whole layers per stage
    for pp in stages:
        mem = _split(state, act, tp, pp, devices.count // (tp * pp))
        if mem.total <= budget:
            return Plan("fsdp2", None, tp, pp, devices.count // (tp * pp), mem, True, reason)
    pp = stages[-1] if stages else 1
    dp = max(1, devices.count // (tp * pp))
    mem = _split(state, act, tp, pp, dp)
    room = budget - act / tp
    need = f"about {math.ceil(sum(state) / room)}" if room > 0 else "more"
    return Plan("fsdp2", None, tp, pp, dp, mem, False,
                f"{reason}; needs {need} devices of {devices.memory / GB:.0f} GiB (or ZeRO-3 with CPU offload)")


def _split(state: tuple[int, int, int], act: int, tp: int, pp: int, dp: int) -> Memory:
    """Per device: the state split over all three degrees; a micro-batch's activations over tp (1F1B
    keeps about one model's worth of micro-batch activations per pipeline stage)."""
    weights, grads, optim = (x // (tp * pp * dp) for x in state)
    return Memory(weights, grads, optim, act // tp)


def job_devices(launch: Any) -> Devices:
    """The devices of this job from ``train.launch`` and what this node has (GPU memory, or RAM per process)."""
    import torch

    count, per_node = launch.world_size, launch.nproc_per_node
    cuda = launch.device == "cuda" or (launch.device == "auto" and torch.cuda.is_available())
    if cuda:
        return Devices(count, per_node, torch.cuda.get_device_properties(0).total_memory, "cuda")
    import psutil

    return Devices(count, per_node, psutil.virtual_memory().total // per_node, "cpu")


def _device(kind: str) -> Any:
    import torch

    return torch.device(kind)


def resolve(cfg: Any, model_config: Any, seq_len: int, log: Any) -> tuple[Any, dict[str, Any]]:
    """``train.strategy: auto`` made concrete: (the config with the chosen strategy, facts for the stats).

    An explicit strategy is returned unchanged. ZeRO-2 becomes ``deepspeed`` with ``zero_optimization:
    {stage: 2}`` unless the config names its own DeepSpeed settings, and FSDP2 when DeepSpeed is not
    installed (it shards more, so it fits where ZeRO-2 does). A tensor-parallel plan sets
    ``train.parallel.tensor`` (FSDP2 over the replicas), a pipeline plan ``train.parallel.pipeline``
    (FSDP2 over each stage's replicas), a 3-D plan both; the degrees are validated against the
    launch and the model (they must divide the world, the heads and the layers).
    """
    if cfg.strategy != "auto":
        return cfg, {}
    from llmpipe.training.model import choose_attention

    devices = job_devices(cfg.launch)
    attention = choose_attention(cfg.model.attention, _device(devices.kind))
    plan = choose(ModelShape.of_llama(model_config), devices, seq_len=seq_len,
                  micro_batch=cfg.micro_batch_size, precision=cfg.precision,
                  checkpointing=cfg.gradient_checkpointing, attention=attention)
    log.info("train.strategy auto: %s", plan.describe())
    if not plan.fits:
        log.warning("train.strategy auto: the estimate does not fit in %.0f GiB per device; trying anyway",
                    HEADROOM * devices.memory / GB)
    return apply(cfg, plan, model_config, log)


def apply(cfg: Any, plan: Plan, model_config: Any, log: Any) -> tuple[Any, dict[str, Any]]:
    """The ``train:`` config that runs ``plan`` (validated again: the degrees must fit the launch)."""
    import importlib.util

    tensor = cfg.parallel.tensor if cfg.parallel.tensor > 1 else plan.tensor_parallel  # explicit wins
    stages = cfg.parallel.pipeline if cfg.parallel.pipeline > 1 else plan.pipeline_parallel
    update: dict[str, Any] = {"strategy": plan.strategy}
    if tensor > 1 or stages > 1:
        from llmpipe.training.parallel import check_divides
        from llmpipe.training.pipeline import check_layers

        check_divides(model_config, tensor)
        check_layers(model_config, stages)
        update = {"strategy": "fsdp2", "parallel": {**cfg.parallel.model_dump(), "tensor": tensor,
                                                    "pipeline": stages}}
    elif plan.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        update["strategy"] = "fsdp2"
        log.info("train.strategy auto: deepspeed is not installed; FSDP2 instead of ZeRO-2")
    elif plan.strategy == "deepspeed" and cfg.deepspeed is None:
        update["deepspeed"] = {"zero_optimization": {"stage": plan.zero_stage}}
    out = type(cfg).model_validate({**cfg.model_dump(), **update})
    facts = {"strategy_chosen": update["strategy"], "strategy_plan": plan.describe()}
    if tensor > 1:
        facts["tensor_parallel"] = tensor
    if stages > 1:
        facts["pipeline_parallel"] = stages
    return out, facts
