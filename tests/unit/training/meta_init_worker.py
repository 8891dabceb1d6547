"""Under torchrun: set up a Trainer from a spec (``argv[1]``) and save the full state dict gathered from its
engine right after initialisation to ``argv[2]`` (rank 0). Used by ``test_training_meta_init.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from llmpipe.training.trainer import Trainer

if __name__ == "__main__":
    trainer = Trainer(json.loads(Path(sys.argv[1]).read_text()))
    trainer.setup()
    on_meta = trainer.meta_init()
    # what this rank holds: its shards (a DTensor's local part), not the whole model
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for p in trainer.engine.module.parameters())
    sd = trainer.engine.full_state_dict()
    if sd is not None:
        torch.save({"state": sd, "meta": on_meta, "engine": trainer.engine.name, "local_numel": local},
                   sys.argv[2])
    if trainer.dist is not None:
        trainer.dist.destroy_process_group()
