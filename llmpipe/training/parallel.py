"""Tensor parallelism on a (data x tensor) device mesh, the torchtitan way, with PyTorch DTensor.

The plan is the one transformers ships with the model (``config.base_model_tp_plan``: q/k/v and
gate/up column-wise, o and down row-wise), applied with torch's own ``parallelize_module``. Each
rank then holds its share of the heads and of the MLP's inner width; the attention's reshapes
infer the local head count (``view(..., -1, head_dim)``), so the module needs no patching.
Embeddings, norms and the LM head stay whole on every rank of a tensor group: the activations
between blocks are replicated, the loss is computed on full logits, and the gradients of the
replicated parameters come out the same on every rank of the group.

Ranks are laid out data-major (torchtitan's order): ranks ``r`` with the same ``r // tensor``
form one tensor group and read the same micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch

STYLES = ("colwise", "rowwise")


def check_divides(model_config: Any, tensor: int) -> None:
    """The heads, KV heads and MLP width must split evenly: say which one does not, by its config key."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = int(getattr(model_config, name))
        if value % tensor:
            raise ValueError(f"train.parallel.tensor: {tensor} does not divide the model's {name} ({value})")


def device_mesh(device: torch.device, world: int, tensor: int) -> Any:
    """The 2-D mesh ``("dp", "tp")``: ``world // tensor`` replicas of ``tensor`` ranks each."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world // tensor, tensor), mesh_dim_names=("dp", "tp"))


def tensor_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The model's own TP plan (transformers' ``base_model_tp_plan``) as torch ``ParallelStyle``s."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unknown = sorted({v for v in plan.values() if v not in styles})
    if not plan or unknown:
        raise ValueError(f"train.parallel.tensor: {type(model).__name__} has no column/row-wise tensor "
                         f"plan (base_model_tp_plan {plan!r}); llmpipe applies only {STYLES}")
    return {key: styles[style]() for key, style in plan.items()}


def parallelize(model: torch.nn.Module, tp_mesh: Any) -> None:
    """Split the decoder blocks of ``model`` (a ``*ForCausalLM``) over ``tp_mesh`` in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_divides(model.config, tp_mesh.size())
    parallelize_module(model.model, tp_mesh, tensor_plan(model))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def clip_grad_norm(params: Any, max_norm: float) -> float:
    """``clip_grad_norm_`` over a model whose gradients mix DTensors and plain tensors.

    torch's own refuses the mix (``_foreach_norm`` wants one kind); the norm is taken per group of
    gradients on one mesh (plain tensors: their own group), each made whole, then combined, and the
    clip coefficient applied to the local shards: the same arithmetic as one process.
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(getattr(g, "device_mesh", None), []).append(g)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        _local(g).mul_(coef.to(g.dtype))
    return float(total)
