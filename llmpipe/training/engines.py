"""Parallelism strategies behind one small interface: DDP, FSDP2 (``fully_shard``), tensor parallel
(DTensor, optionally x FSDP2 on a 2-D mesh: ``train.parallel.tensor``) and DeepSpeed ZeRO.

Every engine does the same four things the training loop needs: a micro-batch forward/backward,
an optimizer step (or a skipped one), a collective checkpoint save/load into a directory, and a full
state dict on rank 0 for the ``save_pretrained`` export. Only the strategy-specific parts live here;
the loop, the schedule, the guards and the metrics are shared (``trainer.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmpipe.training.config import TrainConfig
from llmpipe.training.model import materialize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay matrices, not norms or biases (the usual LLM recipe)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 over non-padding targets (-100 is ignored)."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100)


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def chunked_token_loss(logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`token_loss` computed ``chunk`` tokens at a time: each chunk is upcast to fp32 and its
    log-softmax recomputed in backward (``torch.utils.checkpoint``), so the fp32 copy and log-softmax
    of the whole vocabulary exist for one chunk at a time, never for every token of the micro-batch
    (for 8 x 2048 tokens of a 32k vocabulary: 4 GiB kept through backward otherwise). The same loss
    to float rounding (a sum over chunks divided by the target count instead of one mean)."""
    from torch.utils.checkpoint import checkpoint

    flat, t = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    total = sum(checkpoint(_ce_sum, flat[i:i + chunk], t[i:i + chunk], use_reentrant=False)
                for i in range(0, flat.shape[0], chunk))
    return total / (t != -100).sum().clamp_min(1)


def entity_loss(logits: torch.Tensor, targets: torch.Tensor, entity: torch.Tensor, cfg: Any) -> torch.Tensor:
    """The entity loss of ``train.loss`` (``cfg``) over non-padding targets; ``entity``: 1 where a target
    overlaps an entity span (see :class:`llmpipe.training.config.LossConfig`)."""
    flat, t = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    ce = torch.nn.functional.cross_entropy(flat, t, ignore_index=-100, reduction="none")
    valid = (t != -100).float()
    ent = entity.reshape(-1).float() * valid
    n = valid.sum().clamp_min(1.0)
    if cfg.kind == "weighted":
        return (ce * (valid + (cfg.entity_weight - 1.0) * ent)).sum() / n
    p_target = torch.exp(-ce)  # ce = -log p(target)
    reward = (p_target * ent).sum() / ent.sum().clamp_min(1.0)
    return cfg.alpha * (ce * valid).sum() / n - (1.0 - cfg.alpha) * reward


@functools.cache
def _compiled_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return torch.compile(token_loss)


def compiled_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`token_loss` through ``torch.compile``: Inductor fuses the fp32 upcast into the
    log-sum-exp reduction and the backward's softmax, so no fp32 copy of the logits exists and nothing
    is recomputed. Measured on an H200 (``benchmarks/gpu/run.sh``, gpu-125m): as fast as the plain
    loss, where 4096-token checkpointed chunks cost 19% of the step."""
    return _compiled_loss()(logits, targets)


def _loss(logits: torch.Tensor, targets: torch.Tensor, entity: torch.Tensor | None, cfg: Any) -> torch.Tensor:
    """Plain cross-entropy unless the entity loss is on and a mask came: compiled whole where the model
    is compiled on a GPU, else in chunks of ``train.loss.chunk_tokens`` (0: in one piece)."""
    if entity is None or cfg.loss.entity_weight is None:
        if cfg.compile and logits.is_cuda:
            return compiled_token_loss(logits, targets)
        chunk = cfg.loss.chunk_tokens
        return chunked_token_loss(logits, targets, chunk) if chunk else token_loss(logits, targets)
    return entity_loss(logits, targets, entity, cfg.loss)


def set_lr_or_skip(optimizer: torch.optim.Optimizer, lr: float, skip: bool) -> bool:
    """Set this step's learning rate; on a skipped step drop the gradients instead. True: go on and step."""
    for g in optimizer.param_groups:
        g["lr"] = lr
    if skip:
        optimizer.zero_grad(set_to_none=True)
    return not skip


class Engine:
    """The shared part: autocast, AdamW, grad scaling and clipping for torch-native strategies (fp16:
    GradScaler here, ShardedGradScaler in the DTensor engines, see ``sharded_scaler``)."""

    name = "base"
    checkpoint_format = "dcp"  # how ``save`` writes (``resume.py``: which engines can read it back)
    saves_async = False  # whether ``save_async`` writes in the background (DCP engines)

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.model = model
        self.amp_dtype = DTYPES[cfg.precision]
        # fp16 loss scaling; GradScaler("cpu") works too (the tests run fp16 overflows on the CPU)
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None
        self._scale: float | None = None  # the scale after the last step (read once per step)
        self.overflowed = False  # whether the last step was skipped by the loss scaler (inf/NaN gradients)
        self.optimizer: Any = None

    def autocast(self) -> Any:
        if self.amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        c = self.cfg.optimizer
        return torch.optim.AdamW(params, lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                                 fused=self.device.type == "cuda")

    def start_step(self, lr: float) -> None:
        """Called before a step's first forward; the torch engines set ``lr`` in ``step``."""

    def sync_context(self, last_micro: bool) -> Any:
        return contextlib.nullcontext()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, entity: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        with self.autocast():
            logits = self.model(input_ids=ids).logits
        return _loss(logits, targets, entity, self.cfg), logits

    def backward(self, loss: torch.Tensor, accum: int) -> None:
        loss = loss / accum
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, lr: float, skip: bool) -> float:
        """Apply (or skip) the accumulated gradients; return the global grad norm (before clipping)."""
        self.overflowed = False
        if not set_lr_or_skip(self.optimizer, lr, skip):
            return float("nan")
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.cfg.optimizer.grad_clip
        max_norm = clip if clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.apply_step()
        return float(norm)

    def apply_step(self) -> None:
        """The optimizer step of unscaled, clipped gradients; under fp16 the scaler's (a skip on inf/NaN)."""
        if self.scaler is not None:
            before = self.loss_scale()
            self.scaler.step(self.optimizer)  # skips the optimizer step when a gradient is inf/NaN
            self.scaler.update()  # ... and then lowers the scale: that is how an overflow shows
            self._scale = self.scaler.get_scale()
            self.overflowed = before is not None and self._scale < before
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def loss_scale(self) -> float | None:
        """fp16: the loss scale now (None without loss scaling); a host sync the first time after a load."""
        if self.scaler is None:
            return None
        if self._scale is None:
            self._scale = self.scaler.get_scale()
        return self._scale

    def save(self, path: Path) -> None:  # collective
        raise NotImplementedError

    def save_async(self, path: Path) -> Future[Any] | None:  # collective
        """Start a save into ``path`` and return once the state is staged (copied off the model), with
        the future of the write; None when this engine wrote synchronously (the default: ``save``)."""
        self.save(path)
        return None

    def load(self, path: Path) -> None:  # collective
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:  # collective; rank 0 gets it
        raise NotImplementedError


def compile_blocks(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder block in place (``Module.compile``: the parameter names stay), as
    torchtitan does before ``fully_shard``: FSDP2's all-gathers and reduce-scatters stay between the
    compiled blocks, where a whole-model compile of a sharded model would trace through them."""
    for layer in model.model.layers:
        layer.compile()


def _on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (``build_model(meta=True)``): shard, then materialize."""
    return next(model.parameters()).is_meta


def fully_shard_blocks(model: torch.nn.Module, precision: str, mesh: Any = None) -> bool:
    """Per-decoder-layer ``fully_shard`` plus the root (over ``mesh``, default: all ranks); whether
    FSDP casts the parameters itself (bf16/fp16), so autocast is off. Pretraining and sft shard alike."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": mesh} if mesh is not None else {}
    if precision in ("bf16", "fp16"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return "mp_policy" in kw


def sharded_scaler(cfg: TrainConfig, device: torch.device) -> Any:
    """fp16 loss scaling for DTensor-sharded gradients (FSDP2, tensor parallel): torch's
    ``ShardedGradScaler`` unscales each rank's shards and all-reduces the inf/NaN flag, so an
    overflow on any rank skips the same step on every rank and the scale stays the same everywhere."""
    if cfg.precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type)


class DCPEngine(Engine):
    """Checkpoints of DTensor-sharded models (FSDP2, tensor parallel) via torch.distributed.checkpoint."""

    module: torch.nn.Module
    saves_async = True
    _save_group: Any = None  # the gloo group of asynchronous saves (``save_async``), made on first use

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.module, self.optimizer)
        return {"model": msd, "optim": osd}

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(path / "dcp"))
        if self.scaler is not None and _rank() == 0:  # the same on every rank (its inf flag is all-reduced)
            torch.save(self.scaler.state_dict(), path / "scaler.pt")

    def save_async(self, path: Path) -> Future[Any] | None:
        """``dcp.async_save``: the state is staged into CPU memory here (a copy, so the next optimizer
        steps cannot change what is written), then a background thread writes it and the returned
        future completes once every rank's files and the metadata are written. The thread's
        collectives run on a gloo group of their own (torchtitan's way): on the training group they
        would interleave with the step's all-reduces in a different order on each rank (and NCCL
        cannot stage to CPU)."""
        import torch.distributed.checkpoint as dcp

        if dist.is_initialized() and self._save_group is None:
            self._save_group = dist.new_group(backend="gloo")
        future = dcp.async_save(self._state(), checkpoint_id=str(path / "dcp"), process_group=self._save_group)
        if self.scaler is not None and _rank() == 0:
            torch.save(self.scaler.state_dict(), path / "scaler.pt")
        return future

    def load(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if self.scaler is not None and (path / "scaler.pt").is_file():
            self.scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
            self._scale = None

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if _rank() == 0 else None


class DDPEngine(DCPEngine):
    """DistributedDataParallel; checkpoints through DCP as the sharded engines, so a DDP run resumes
    as FSDP2 or tensor parallel (DCP reshards the full tensors) and the other way round."""

    name = "ddp"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(device)
        self.module = model
        super().__init__(model, cfg, device)
        if _world() > 1:
            self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if cfg.compile:
            self.model = torch.compile(self.model)
        self.optimizer = self.make_optimizer(param_groups(model, cfg.optimizer.weight_decay))

    def sync_context(self, last_micro: bool) -> Any:
        if last_micro or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def load(self, path: Path) -> None:
        """DCP, or the one ``model_optim.pt`` of a checkpoint written before DDP saved through DCP."""
        legacy = path / "model_optim.pt"
        if not legacy.is_file():
            super().load(path)
            return
        state = torch.load(legacy, map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
            self._scale = None

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()} if _rank() == 0 else None


class FSDP2Engine(DCPEngine):
    """Per-decoder-layer ``fully_shard`` plus the root; checkpoints via torch.distributed.checkpoint."""

    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> None:
        meta = _on_meta(model)
        model = model if meta else model.to(device)
        if cfg.compile:
            compile_blocks(model)
        casts = fully_shard_blocks(model, cfg.precision)
        if meta:
            materialize(model, device, cfg.seed)
        super().__init__(model, cfg, device)
        if casts:
            self.amp_dtype = torch.float32  # FSDP casts parameters itself
        self.scaler = sharded_scaler(cfg, device)
        self.module = model
        self.optimizer = self.make_optimizer(param_groups(model, cfg.optimizer.weight_decay))


def _dtensors_first(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups with their DTensor parameters ahead of the plain ones: the scaler unscales each
    dtype's gradients in one DTensor op whose inf check reads the mesh off the first gradient, so
    a plain (replicated, not split) one must not come first. Per-parameter AdamW: the order changes
    nothing else."""
    from torch.distributed.tensor import DTensor

    return [{**g, "params": sorted(g["params"], key=lambda p: not isinstance(p, DTensor))} for g in groups]


class TensorParallelEngine(DCPEngine):
    """``train.parallel.tensor`` ranks per replica (DTensor, ``parallel.py``), FSDP2 over the replicas.

    On one replica (world == tensor) the strategy's data parallelism has nothing to do; with more,
    ``fully_shard`` shards over the mesh's data dimension (torchtitan's 2-D FSDP x TP).
    """

    name = "tp"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> None:
        from llmpipe.training.parallel import device_mesh, parallelize

        meta = _on_meta(model)
        model = model if meta else model.to(device)
        self.mesh = device_mesh(device, _world(), cfg.parallel.tensor)
        parallelize(model, self.mesh["tp"])
        if cfg.compile:
            compile_blocks(model)
        casts = self.mesh["dp"].size() > 1 and fully_shard_blocks(model, cfg.precision, self.mesh["dp"])
        if meta:
            materialize(model, device, cfg.seed)
        super().__init__(model, cfg, device)
        if casts:
            self.amp_dtype = torch.float32
        self.scaler = sharded_scaler(cfg, device)
        self.module = model
        self.optimizer = self.make_optimizer(param_groups(model, cfg.optimizer.weight_decay))

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        c = self.cfg.optimizer
        if self.scaler is not None:
            params = _dtensors_first(params)
        return torch.optim.AdamW(params, lr=c.lr, betas=tuple(c.betas), eps=c.eps)  # fused: no DTensor

    def step(self, lr: float, skip: bool) -> float:
        """As the base, with a grad norm over DTensor and plain gradients (``parallel.clip_grad_norm``)."""
        from llmpipe.training.parallel import clip_grad_norm

        self.overflowed = False
        if not set_lr_or_skip(self.optimizer, lr, skip):
            return float("nan")
        if self.scaler is not None:
            from torch.distributed.tensor.experimental import implicit_replication

            with implicit_replication():  # the plain (not split) gradients are replicated over the tp ranks
                self.scaler.unscale_(self.optimizer)
        clip = self.cfg.optimizer.grad_clip
        norm = clip_grad_norm(self.module.parameters(), clip if clip > 0 else float("inf"))
        self.apply_step()
        return norm


def deepspeed_config(cfg: TrainConfig, world: int, base_dir: Path | None = None, cuda: bool = False
                     ) -> dict[str, Any]:
    """The DeepSpeed JSON: the user's file or inline dict, with batch, optimizer and precision filled in.

    Batch sizes, optimizer, clipping and precision come from ``train:`` so the same YAML means the
    same run under every strategy; the user's config contributes ZeRO stage, offload and tuning knobs.
    With bf16/fp16, gradients are communicated in fp32 as FSDP2 reduces them (``reduce_dtype``). On
    the GPU (``cuda``) DeepSpeed picks its own Adam (fused, or DeepSpeedCPUAdam for an offloaded
    optimizer); on the CPU torch's AdamW, unless the user's file says otherwise: DeepSpeed's CPU
    Adam JIT-compiles for minutes on first use.
    """
    user: dict[str, Any] = {}
    if isinstance(cfg.deepspeed, dict):
        user = json.loads(json.dumps(cfg.deepspeed))
    elif isinstance(cfg.deepspeed, str):
        p = Path(cfg.deepspeed)
        if not p.is_absolute() and base_dir is not None and not p.exists():
            p = base_dir / p
        user = json.loads(p.read_text())
    zero = dict(user.get("zero_optimization") or {"stage": 1})
    _check_skips(zero)
    if int(zero.get("stage", 0)) == 3:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    offload = any(k in zero for k in ("offload_optimizer", "offload_param"))
    accum = cfg.global_batch_size // (cfg.micro_batch_size * world)
    opt = cfg.optimizer
    out = dict(user)
    out.update({
        "train_batch_size": cfg.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": opt.grad_clip,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {
            "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
            "torch_adam": bool(user.get("optimizer", {}).get("params", {}).get("torch_adam", not cuda)),
            "adam_w_mode": True}},
        # a non-finite loss skips the step through ZeRO's gradient overflow check (DeepSpeedEngine.step)
        "bf16": {"enabled": cfg.precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        **({"communication_data_type": "fp32"} if cfg.precision != "fp32" else {}),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    })
    if offload and out["optimizer"]["params"]["torch_adam"]:
        out["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the offloaded states
    return out


def _check_skips(zero: dict[str, Any]) -> None:
    """A non-finite loss must skip its step: under DeepSpeed that is ZeRO's overflow check, which needs
    a ZeRO stage and the global grad norm; refuse a config that turns either off."""
    if int(zero.get("stage", 0)) < 1:
        raise ValueError("train.deepspeed: zero_optimization.stage must be 1, 2 or 3 (stage 0 steps over "
                         "non-finite gradients); for plain data parallelism use strategy ddp")
    if zero.get("compute_grad_norm") is False:
        raise ValueError("train.deepspeed: zero_optimization.compute_grad_norm must stay true: a step with "
                         "non-finite gradients is skipped by the grad norm check")


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO 1/2/3 (+ offload). DeepSpeed owns accumulation, clipping and loss scaling."""

    name = "deepspeed"
    checkpoint_format = "deepspeed"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device, ds_config: dict[str, Any]) -> None:
        import deepspeed

        super().__init__(model, cfg, device)
        self.amp_dtype = torch.float32  # DeepSpeed casts the model itself for bf16/fp16
        self.scaler = None
        self.ds_config = ds_config
        self.stage = int(ds_config["zero_optimization"].get("stage", 0))
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg.optimizer.weight_decay), config=ds_config)
        self.model = self.engine
        if cfg.compile:
            self.engine.compile()

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, entity: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.engine(input_ids=ids).logits
        return _loss(logits, targets, entity, self.cfg), logits

    def backward(self, loss: torch.Tensor, accum: int) -> None:
        self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        self.engine.step()  # only applies the optimizer at the accumulation boundary

    def start_step(self, lr: float) -> None:
        """DeepSpeed steps inside the last micro-batch's backward: its learning rate is set before."""
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr

    def step(self, lr: float, skip: bool) -> float:
        """DeepSpeed has already stepped, or skipped, inside the last backward: a non-finite loss made
        non-finite gradients (all-reduced: on every rank), and its ZeRO optimizer's overflow check
        then dropped them without touching the weights, the moments or the step count (fp16: and
        lowered the loss scale). Here the trainer's verdict and DeepSpeed's are checked to agree."""
        applied = self.engine.was_step_applied()
        if skip and applied:
            raise RuntimeError("DeepSpeed applied a step whose loss was non-finite: its gradient overflow check "
                               "is off (train.deepspeed: keep bf16.check_grad_overflow and "
                               "zero_optimization.compute_grad_norm true)")
        self.overflowed = self.cfg.precision == "fp16" and not skip and not applied
        norm = self.engine.get_global_grad_norm()
        return float("nan") if skip or norm is None else float(norm)

    def loss_scale(self) -> float | None:
        """fp16: the scale of DeepSpeed's fp16 / ZeRO optimizer (its ``loss_scale`` property)."""
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.cfg.precision == "fp16" else None
        return None if scale is None else float(scale)

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path / "ds"), tag="state")

    def load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path / "ds"), tag="state", load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {path / 'ds'}")

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.stage == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            sd = self.engine.module.state_dict()
        if _rank() != 0 or sd is None:
            return None
        return {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu() for k, v in sd.items()}


def make_engine(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, ds_config: dict[str, Any] | None) -> Engine:
    if cfg.parallel.tensor > 1:
        return TensorParallelEngine(model, cfg, device)
    if cfg.strategy == "ddp":
        return DDPEngine(model, cfg, device)
    if cfg.strategy == "fsdp2":
        return FSDP2Engine(model, cfg, device)
    if cfg.strategy == "deepspeed":
        assert ds_config is not None
        return DeepSpeedEngine(model, cfg, device, ds_config)
    raise ValueError(f"train.strategy: unknown strategy {cfg.strategy!r}")


def is_finite(x: float) -> bool:
    return math.isfinite(x)
