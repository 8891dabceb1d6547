"""Resume that checks before it loads: a checkpoint records how it was written, and a run whose
settings changed since either reshards it or stops with one line.

``train.parallel`` and ``train.launch`` are run settings, outside the stage key, so a run whose
tensor degree, world size or strategy changed resumes from the same checkpoint folder. What an
engine can read depends on how the checkpoint was written:

- ``dcp`` (DDP, FSDP2, tensor parallel, FSDP2 x tensor parallel): torch.distributed.checkpoint files
  keyed by parameter name and global shape; DCP reads them into any other sharding of the same
  model, so a change among these engines or of the world size reshards on load (torchtitan's way).
- ``deepspeed`` (ZeRO 1/2/3): DeepSpeed's own partitioned files, readable at the same ZeRO stage and
  world size only.
- ``pipeline``: one file or DCP folder per stage, readable at the same degrees and world only.

Anything else stops before a single tensor is read, with one line naming the setting that changed
and what to do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


class ResumeMismatch(RuntimeError):
    """The checkpoint cannot be read by this run's engine; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class CheckpointLayout:
    """How a checkpoint was written: its format, the engine and strategy, and the world and mesh."""

    format: str  # dcp | deepspeed | pipeline | torch (before layouts were recorded: DDP's one file)
    engine: str
    strategy: str
    world: int
    tensor: int = 1
    pipeline: int = 1
    zero_stage: int | None = None

    @classmethod
    def of(cls, engine: Any, cfg: Any, world: int) -> CheckpointLayout:
        """This run's layout: ``engine`` is the trainer's engine, ``cfg`` its ``train:`` section."""
        return cls(engine.checkpoint_format, engine.name, cfg.strategy, world, cfg.parallel.tensor,
                   cfg.parallel.pipeline, getattr(engine, "stage", None))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, state: dict[str, Any], path: Path) -> CheckpointLayout:
        """The layout a ``state.json`` records; for a checkpoint written before layouts were recorded,
        what its files say (DDP's ``model_optim.pt``, a ``dcp/``, ``ds/`` or ``stage_*`` folder)."""
        if "layout" in state:
            return cls(**state["layout"])
        world = int(state.get("world", 1))
        if (path / "model_optim.pt").is_file():
            return cls("torch", "ddp", "ddp", world)
        if (path / "ds").is_dir():
            return cls("deepspeed", "deepspeed", "deepspeed", world)
        if any(path.glob("stage_*")):
            return cls("pipeline", "pp", "unknown", world, pipeline=len(list(path.glob("stage_*"))))
        return cls("dcp", "unknown", "unknown", world)


# the settings a layout depends on, in the order a mismatch is reported, and their YAML names
_SETTINGS = (("strategy", "train.strategy"), ("zero_stage", "train.deepspeed zero_optimization.stage"),
             ("pipeline", "train.parallel.pipeline"), ("tensor", "train.parallel.tensor"),
             ("world", "the world size (train.launch.nodes x train.launch.nproc_per_node)"))


def changes(saved: CheckpointLayout, now: CheckpointLayout) -> list[tuple[str, Any, Any]]:
    """(setting, then, now) of each setting that differs, ``_SETTINGS``' order."""
    return [(name, getattr(saved, f), getattr(now, f)) for f, name in _SETTINGS
            if getattr(saved, f) != getattr(now, f) and getattr(saved, f) != "unknown"]


def check(saved: CheckpointLayout, now: CheckpointLayout, where: str) -> bool:
    """Whether this run can read the checkpoint at ``where``: False when nothing changed, True when
    it reshards through DCP; raises :class:`ResumeMismatch` (one line) when it cannot read it."""
    diff = changes(saved, now)
    if saved.format == now.format and not diff:
        return False
    if saved.format == now.format == "dcp":
        return True
    if saved.format == "torch" and now.engine == "ddp":
        return False  # a full state dict: any world size reads it
    name, then, new = diff[0] if diff else ("the checkpoint format", saved.format, now.format)
    raise ResumeMismatch(
        f"cannot resume from {where}: {name} is {new} now but was {then} when it was saved "
        f"({saved.engine} engine, {saved.format} checkpoint, world {saved.world}), and a {saved.format} "
        f"checkpoint is read only by the engine and world that wrote it: set {name} back to {then}, "
        "or start afresh with train.checkpoint.resume: false or another train.checkpoint.dir")
