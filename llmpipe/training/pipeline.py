"""Pipeline parallelism (``train.parallel.pipeline``): decoder layers split into stages, one per rank,
run by a ``torch.distributed.pipelining`` schedule (1F1B or GPipe) over the step's micro-batches.

Each rank keeps only its stage of the model, under the module names of the whole model (stage 1 of
2 holds ``model.layers.1``, ``model.norm`` and ``lm_head``), so the exported state dict uses the
same keys as every other strategy; a checkpoint holds one file per stage (its weights and AdamW
state), since the stages share no tensor. The first
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
from llmpipe.training.engines import Engine, param_groups, set_lr_or_skip, token_loss


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
    layers = int(model_config.num_hidden_layers)
    if layers % stages:
        raise ValueError(f"train.parallel.pipeline: {stages} stages do not divide the model's "
                         f"num_hidden_layers ({layers})")


class PipelineEngine(Engine):
    """One pipeline stage per rank; the whole step's micro-batches go through one schedule call."""

    name = "pp"

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device, micro_batches: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stages = cfg.parallel.pipeline
        check_layers(model.config, stages)
        self.stage_index, self.stages = dist.get_rank(), stages
        per = model.config.num_hidden_layers // stages
        r = self.stage_index
        module = StageModule(model, r * per, (r + 1) * per, r == 0, r == stages - 1).to(device)
        super().__init__(module, cfg, device)
        self.module = module
        self.full_config = model.config
        stage = PipelineStage(module, r, stages, device)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[cfg.parallel.schedule]
        self.schedule = kind(stage, n_microbatches=micro_batches, loss_fn=token_loss)
        self.optimizer = self.make_optimizer(param_groups(module, cfg.optimizer.weight_decay))

    @property
    def last(self) -> bool:
        return self.stage_index == self.stages - 1

    def train_batch(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of the whole step (``ids``: all its micro-batches stacked); the mean
        micro-batch loss, sent from the last stage to every rank."""
        losses: list[torch.Tensor] = []
        with self.autocast():  # bf16: the schedule runs forward and backward of every micro-batch here
            if self.stage_index == 0:
                self.schedule.step(ids, target=targets if self.last else None, losses=losses)
            else:
                self.schedule.step(target=targets if self.last else None, losses=losses)
        loss = torch.stack(losses).mean().detach().float() if self.last else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.stages - 1)
        return float(loss)

    def step(self, lr: float, skip: bool) -> float:
        """The global grad norm is the root of the stages' summed squares; clip, then step."""
        if not set_lr_or_skip(self.optimizer, lr, skip):
            return float("nan")
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        sq = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in grads]).sum()
        dist.all_reduce(sq)
        total = sq.sqrt()
        clip = self.cfg.optimizer.grad_clip
        coef = torch.clamp((clip if clip > 0 else float("inf")) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)

    def save(self, path: Path) -> None:
        state = {"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}
        torch.save(state, path / f"stage_{self.stage_index}.pt")

    def load(self, path: Path) -> None:
        state = torch.load(path / f"stage_{self.stage_index}.pt", map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every stage's weights, gathered on rank 0 (the stages hold disjoint keys)."""
        mine = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        parts: list[Any] = [None] * self.stages
        dist.all_gather_object(parts, mine)
        if self.stage_index != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        return merged
