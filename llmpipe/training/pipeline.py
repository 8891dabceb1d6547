"""Pipeline parallelism (``train.parallel.pipeline``): decoder layers split into stages run by a
``torch.distributed.pipelining`` schedule (1F1B or GPipe) over the step's micro-batches, optionally
combined with data parallelism and tensor parallelism (3-D, as torchtitan composes them).

The world is a mesh ``("dp", "pp")`` (``("dp", "pp", "tp")`` with ``train.parallel.tensor``), laid
out data-major like the tensor-parallel mesh: rank ``r`` is tensor rank ``r % tp`` of stage
``(r // tp) % stages`` of replica ``r // (stages * tp)`` (the trainer's ``dp_rank``), so each replica
reads its own slice of the global batch in the same ``GlobalOrder`` as DDP, and the ranks of one
stage's tensor group read the same one. A stage's decoder blocks are split over its tensor group
first (``parallel.py``'s plan); with more than one replica each stage is then sharded over its
data-parallel group with FSDP2 ``fully_shard`` (per decoder layer, then the stage), the way
torchtitan shards every pipeline model part; the pipeline stage itself drives FSDP's gradient
reduction at the step's last backward.

Each rank keeps only its stage of the model, under the module names of the whole model (stage 1 of
2 holds ``model.layers.1``, ``model.norm`` and ``lm_head``), so the exported state dict uses the
same keys as every other strategy; a checkpoint holds one entry per stage (its weights and AdamW
state: a file on its own, a ``torch.distributed.checkpoint`` folder written by all the stage's
ranks when it is sharded), since the stages share no tensor. The first
stage embeds the tokens, the last applies the final norm, the LM head and the loss; each stage
computes the rotary position embeddings itself, and the attention is causal without a mask (the
packed sequences have no padding inside the model's view).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmpipe.training.config import TrainConfig
from llmpipe.training.engines import DTYPES, Engine, param_groups, set_lr_or_skip, token_loss


class StageModule(torch.nn.Module):
    """Layers ``[lo, hi)`` of a ``*ForCausalLM``, with the embedding on the first stage and the
    norm and head on the last, under the whole model's module names."""

    def __init__(self, model: torch.nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        inner = torch.nn.Module()
        inner.embed_tokens = model.model.embed_tokens if first else None
        inner.layers = torch.nn.ModuleDict({str(i): model.model.layers[i] for i in range(lo, hi)})
        inner.rotary_emb = model.model.rotary_emb
        inner.norm = model.model.norm if last else None
        self.model = inner
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.embed_tokens(x) if m.embed_tokens is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        emb = m.rotary_emb(h, pos)
        for layer in m.layers.values():
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=emb)
            h = h[0] if isinstance(h, tuple) else h
        return self.lm_head(m.norm(h)) if self.lm_head is not None else h


def check_layers(model_config: Any, stages: int) -> None:
    """Whole layers per stage; and untied embeddings, since the first and the last stage would each
    train their own copy of a tied matrix."""
    layers = int(model_config.num_hidden_layers)
    if layers % stages:
        raise ValueError(f"train.parallel.pipeline: {stages} stages do not divide the model's "
                         f"num_hidden_layers ({layers})")
    if stages > 1 and getattr(model_config, "tie_word_embeddings", False):
        raise ValueError("train.parallel.pipeline: tied input and output embeddings "
                         "(train.model.overrides.tie_word_embeddings) live on different stages; untie them")


def device_mesh(device: torch.device, world: int, stages: int, tensor: int = 1) -> Any:
    """The mesh ``("dp", "pp")``: ``world // stages`` replicas of ``stages`` ranks each; with
    ``tensor > 1`` ``("dp", "pp", "tp")``, each stage ``tensor`` ranks wide."""
    from torch.distributed.device_mesh import init_device_mesh

    if tensor == 1:
        return init_device_mesh(device.type, (world // stages, stages), mesh_dim_names=("dp", "pp"))
    return init_device_mesh(device.type, (world // (stages * tensor), stages, tensor),
                            mesh_dim_names=("dp", "pp", "tp"))


def stage_group(mesh: Any, stage: int, stages: int, tensor: int) -> Any:
    """The process group of every rank holding stage ``stage`` (all its replicas and tensor ranks):
    the one that writes and reads that stage's checkpoint. Collective: every rank creates them all."""
    if tensor == 1:
        return mesh["dp"].get_group()
    world = dist.get_world_size()
    groups = [dist.new_group([r for r in range(world) if (r // tensor) % stages == s]) for s in range(stages)]
    return groups[stage]


def parallelize_stage(module: StageModule, full: torch.nn.Module, tp_mesh: Any) -> None:
    """Split the stage's decoder blocks over ``tp_mesh`` with the whole model's tensor plan (its keys,
    ``layers.*.self_attn.q_proj`` and so on, match the stage's module names)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from llmpipe.training.parallel import check_divides, tensor_plan

    check_divides(full.config, tp_mesh.size())
    parallelize_module(module.model, tp_mesh, tensor_plan(full))


def shard_stage(module: StageModule, cfg: TrainConfig, dp_mesh: Any) -> bool:
    """FSDP2 over the data-parallel group: each decoder layer, then the stage (embedding, norm, head).

    As torchtitan does under pipeline parallelism, parameters stay gathered from a micro-batch's
    forward to its backward (``reshard_after_forward=False``): one all-gather per step instead of
    one per micro-batch. Returns whether FSDP casts the parameters itself (bf16), so autocast is off.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": False}
    if cfg.precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES["bf16"], reduce_dtype=torch.float32)
    for layer in module.model.layers.values():
        fully_shard(layer, **kw)
    fully_shard(module, **kw)
    return "mp_policy" in kw


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_sharded(g: torch.Tensor) -> bool:
    """Whether ``g`` is split over the mesh's ``tp`` dimension (else every tensor rank holds it whole)."""
    from torch.distributed.tensor import Shard

    names = getattr(getattr(g, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tp" in names and isinstance(g.placements[names.index("tp")], Shard)


class PipelineEngine(Engine):
    """One pipeline stage per rank (or per tensor group), FSDP2 over the replicas of a stage; the
    whole step's micro-batches go through one schedule call."""

    name = "pp"
    checkpoint_format = "pipeline"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device, micro_batches: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stages, tensor = cfg.parallel.pipeline, cfg.parallel.tensor
        check_layers(model.config, stages)
        self.mesh = device_mesh(device, dist.get_world_size(), stages, tensor)
        self.stage_index, self.stages, self.tensor = self.mesh.get_local_rank("pp"), stages, tensor
        self.replicas = self.mesh["dp"].size()
        self.tp_rank = self.mesh.get_local_rank("tp") if tensor > 1 else 0
        self.sharded = self.replicas * tensor > 1
        self.group = stage_group(self.mesh, self.stage_index, stages, tensor)
        per = model.config.num_hidden_layers // stages
        r = self.stage_index
        module = StageModule(model, r * per, (r + 1) * per, r == 0, r == stages - 1).to(device)
        if tensor > 1:
            parallelize_stage(module, model, self.mesh["tp"])
        casts = self.replicas > 1 and shard_stage(module, cfg, self.mesh["dp"])
        super().__init__(module, cfg, device)
        if casts:
            self.amp_dtype = torch.float32  # FSDP casts parameters itself
        self.module = module
        self.full_config = model.config
        stage = PipelineStage(module, r, stages, device, group=self.mesh["pp"].get_group())
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[cfg.parallel.schedule]
        self.schedule = kind(stage, n_microbatches=micro_batches, loss_fn=token_loss)
        self.optimizer = self.make_optimizer(param_groups(module, cfg.optimizer.weight_decay))

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.cfg.parallel.tensor == 1:
            return super().make_optimizer(params)
        c = self.cfg.optimizer  # as the tensor-parallel engine: no fused AdamW over mixed DTensors
        return torch.optim.AdamW(params, lr=c.lr, betas=tuple(c.betas), eps=c.eps)

    @property
    def last(self) -> bool:
        return self.stage_index == self.stages - 1

    def train_batch(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of the whole step (``ids``: all its micro-batches stacked); the mean
        micro-batch loss over every replica (each one's last stage contributes its mean: its first
        tensor rank, the others hold the same value), on every rank."""
        losses: list[torch.Tensor] = []
        with self.autocast():  # bf16: the schedule runs forward and backward of every micro-batch here
            if self.stage_index == 0:
                self.schedule.step(ids, target=targets if self.last else None, losses=losses)
            else:
                self.schedule.step(target=targets if self.last else None, losses=losses)
        mine = self.last and self.tp_rank == 0
        loss = torch.stack(losses).mean().detach().float() if mine else torch.zeros((), device=self.device)
        dist.all_reduce(loss)  # the other ranks add zero
        return float(loss) / self.replicas

    def step(self, lr: float, skip: bool) -> float:
        """The global grad norm is the root of the summed squares of every rank's gradients: each
        element lives on exactly one rank of its stage's replicas (a whole stage alone, or its FSDP2
        shard of the reduced gradient) and, under tensor parallelism, on one tensor rank when the
        plan splits it, else on all of them (counted 1/tp each); so the sum over the world counts
        every element once. Clip, then step."""
        if not set_lr_or_skip(self.optimizer, lr, skip):
            return float("nan")
        full = [p.grad for p in self.module.parameters() if p.grad is not None]
        grads = [_local(g) for g in full]
        squares = [torch.linalg.vector_norm(g) ** 2 for g in grads]
        if self.tensor > 1:
            squares = [q if _tensor_sharded(g) else q / self.tensor for q, g in zip(squares, full, strict=True)]
        sq = torch.stack(squares).sum()
        dist.all_reduce(sq)
        total = sq.sqrt()
        clip = self.cfg.optimizer.grad_clip
        coef = torch.clamp((clip if clip > 0 else float("inf")) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)

    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.module, self.optimizer)
        return {"model": msd, "optim": osd}

    def save(self, path: Path) -> None:
        """One entry per stage: its file, or (sharded) a DCP folder all of the stage's ranks write."""
        if self.sharded:
            import torch.distributed.checkpoint as dcp

            dcp.save(self._dcp_state(), checkpoint_id=str(path / f"stage_{self.stage_index}"),
                     process_group=self.group)
            return
        state = {"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}
        torch.save(state, path / f"stage_{self.stage_index}.pt")

    def load(self, path: Path) -> None:
        if self.sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self._dcp_state()
            dcp.load(state, checkpoint_id=str(path / f"stage_{self.stage_index}"), process_group=self.group)
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            return
        state = torch.load(path / f"stage_{self.stage_index}.pt", map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every stage's weights, gathered on rank 0 (the stages hold disjoint keys; a sharded stage
        is made whole over its replicas and tensor ranks, and its first rank sends it)."""
        mine = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in self.module.state_dict().items()}
        parts: list[Any] = [None] * dist.get_world_size()
        first = self.mesh.get_local_rank("dp") == 0 and self.tp_rank == 0
        dist.all_gather_object(parts, mine if first else {})
        if dist.get_rank() != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged
