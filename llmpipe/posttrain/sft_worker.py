"""One SFT worker under torchrun: ``python -m llmpipe.posttrain.sft_worker --config spec.json``.

With ``sft.launch.nproc_per_node > 1`` the sft stage starts its workers as pretraining does
(``sft_launch.launch_sft``, through ``llmpipe.training.launch.launch`` (torchrun, one session per worker, logs streamed into the stage's
logger, the failed rank named from ``errors/rank_<r>.json``, the whole tree stopped when the stage
ends however it ends)). Each worker runs :func:`llmpipe.posttrain.sft.train` on its share of every
step's pairs, its model wrapped in DDP or FSDP2 (``sft.strategy``); rank 0 prints one
``LLMPIPE_METRIC`` line per step (the stage's progress and ``metrics.jsonl``) and saves the model
folder. The entry is ``llmpipe.training.trainer.run_worker``, so a worker reports its failure and
ends exactly as a pretraining worker does.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from llmpipe.posttrain.sft_launch import read_pairs


class SftWorker:
    """One rank: load the model, wrap it (DDP / FSDP2), train its share, rank 0 saves; ``run`` as a
    ``Trainer``'s, for ``llmpipe.training.trainer.main``."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from llmpipe.posttrain.config import SftConfig

        self.spec = spec
        self.cfg = SftConfig.model_validate(spec["sft"])
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))

    def run(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from llmpipe.posttrain import sft
        from llmpipe.posttrain.stage import load_model
        from llmpipe.training.trainer import METRIC_PREFIX

        cfg = self.cfg
        want_cuda = cfg.launch.device == "cuda" or (cfg.launch.device == "auto" and torch.cuda.is_available())
        device = torch.device(f"cuda:{self.local_rank}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(device)
            if cfg.launch.deterministic:  # as pretraining's workers (the CPU kernels are deterministic anyway)
                torch.use_deterministic_algorithms(True, warn_only=True)
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        dist.init_process_group(backend="nccl" if want_cuda else "gloo")
        model, tok = load_model(Path(self.spec["src"]), "sft (worker)")
        model.to(device)
        pairs = read_pairs(Path(self.spec["pairs"]))
        shapes: list[dict[str, Any]] = []

        def report(step: int, loss: float) -> None:
            if self.rank == 0:
                print(METRIC_PREFIX + json.dumps({"step": step, "loss": loss}), flush=True)

        t0 = time.time()
        records = sft.train(model, tok, pairs, steps=cfg.max_steps, batch_size=cfg.batch_size, lr=cfg.lr,
                            weight_decay=cfg.weight_decay, max_length=cfg.max_length, seed=cfg.seed,
                            packing=cfg.packing, shapes=shapes, on_step=report, rank=self.rank, world=self.world,
                            wrap=lambda m: self.wrap(m, device))
        train_s = time.time() - t0
        self.save(model, tok)
        if self.rank == 0:
            summary = {"records": records, "shapes": shapes, "train_s": train_s}
            (Path(self.spec["run_dir"]) / "summary.json").write_text(json.dumps(summary))
        dist.barrier()
        return {}

    def wrap(self, model: Any, device: Any) -> Any:
        """DDP (a whole replica per rank) or FSDP2 (``fully_shard`` per decoder layer, then the root)."""
        if self.cfg.strategy == "fsdp2":
            from llmpipe.training.engines import fully_shard_blocks

            fully_shard_blocks(model, "fp32")  # sft trains in fp32
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def save(self, model: Any, tok: Any) -> None:
        """Rank 0 writes the model folder (under FSDP2 from the full state dict every rank helps gather)."""
        from llmpipe.posttrain.stage import load_model, save_model

        if self.cfg.strategy == "fsdp2":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.rank == 0:
                model, _ = load_model(Path(self.spec["src"]), "sft (worker)")
                model.load_state_dict(state)
        if self.rank == 0:
            save_model(model.cpu(), tok, Path(self.spec["out"]))


if __name__ == "__main__":
    from llmpipe.training.trainer import run_worker

    run_worker(SftWorker)  # type: ignore[arg-type]  # duck-typed: __init__(spec) and run()
