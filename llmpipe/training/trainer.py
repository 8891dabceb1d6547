"""One training process: ``python -m llmpipe.training.trainer --config spec.json`` under torchrun/deepspeed.

The launcher (``launch.py``) writes the spec (the ``train:`` section plus paths resolved by the
stage) and starts one of these per device. Rank/world come from the launcher's environment. Rank 0
writes ``metrics.jsonl`` into the run folder (results and measurements of each step), prints one
``LLMPIPE_METRIC {...}`` line per logged step (the launcher turns them into live progress), and exports the final model with ``save_pretrained``. Any rank
that fails writes ``errors/rank_<r>.json`` so the launcher can name the rank and the error.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import random
import resource
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmpipe.training.config import TrainConfig

METRIC_PREFIX = "LLMPIPE_METRIC "
# Fields of a step record that measure the run (speed, memory) rather than the training result: they
# stay in the run folder's metrics.jsonl and the manifest's stats, never in the published artifact.
MEASURED_FIELDS = ("tokens_per_s", "flops_per_s", "mfu", "peak_mem_mb", "step_time_s", "data_wait_s",
                   "data_wait_share", "memory_mb", "reserved_mb")
log = logging.getLogger("llmpipe.training.trainer")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``optimizer.lr``, then cosine (optionally with warm restarts) down to
    ``schedule.min_lr_ratio * lr``, or warmup-stable-decay (``wsd``: linear to the floor over the last
    ``cfg.wsd_decay_steps``); ``cfg`` is the ``train:`` section (the cosine spans ``max_steps``)."""
    sched = cfg.schedule
    base, floor = cfg.optimizer.lr, cfg.optimizer.lr * sched.min_lr_ratio
    if step < sched.warmup_steps:
        return base * (step + 1) / sched.warmup_steps
    if sched.kind == "constant":
        return base
    if sched.kind == "wsd":
        decay = cfg.wsd_decay_steps
        into = step - (cfg.max_steps - decay)
        return base if into < 0 else base - (base - floor) * (into + 1) / decay
    t = step - sched.warmup_steps
    total = max(1, cfg.max_steps - sched.warmup_steps)
    if sched.kind == "cosine_restarts":
        period = sched.restart_period or max(1, total // 2)
        frac = (t % period) / period
    else:
        frac = min(1.0, t / total)
    return floor + 0.5 * (base - floor) * (1 + math.cos(math.pi * frac))


def _peak_mem_mb(device: Any) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Trainer:
    """The loop shared by every strategy: data order, accumulation, guards, metrics, checkpoints."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        from llmpipe.training.config import TrainConfig

        self.spec = spec
        self.cfg = TrainConfig.model_validate(spec["train"])
        self.run_dir = Path(spec["run_dir"])
        self.ckpt_root = Path(spec["checkpoint_dir"])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = self.cfg.launch.device
        want_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        self.device = torch.device(f"cuda:{self.local_rank}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        # FSDP2 shards over a process group even of one rank (a one-GPU run of an FSDP2 preset)
        one_rank_fsdp2 = self.cfg.strategy == "fsdp2" and "MASTER_ADDR" in os.environ
        if (self.world > 1 or one_rank_fsdp2) and not dist.is_initialized():
            backend = "nccl" if want_cuda else "gloo"
            if self.cfg.strategy == "deepspeed":
                import deepspeed

                if not want_cuda:  # see the adapter: the CPU shm op would JIT-compile for minutes
                    from llmpipe.training.deepspeed_adapter import skip_shm_comm_build

                    skip_shm_comm_build()
                deepspeed.init_distributed(dist_backend=backend)
            else:
                dist.init_process_group(backend=backend)
        self.dist = dist if dist.is_initialized() else None
        if want_cuda and self.cfg.launch.deterministic:
            # CPU kernels used here are deterministic already; on the GPU it costs speed (and DeepSpeed ~100x)
            torch.use_deterministic_algorithms(True, warn_only=True)

    # -- collectives that degrade to no-ops in a single process ------------------------------------
    def _any(self, flag: bool) -> bool:
        import torch

        if self.dist is None:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def _mean(self, x: float) -> float:
        import torch

        if self.dist is None:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return float(t.item()) / self.world

    def _barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    # -- setup -------------------------------------------------------------------------------------
    def setup(self) -> None:
        import numpy as np
        import torch

        from llmpipe.training.data import GlobalOrder, open_packed
        from llmpipe.training.engines import deepspeed_config, make_engine
        from llmpipe.training.model import build_model, device_peak_flops, flops_per_token

        cfg = self.cfg
        self.source = open_packed(self.spec["data_dir"], cfg.split)
        self.seq_len = int(self.spec["seq_len"])
        # the ranks of one model replica (its tensor and pipeline ranks) read the same micro-batches
        # (the data-major layout of parallel.py's and pipeline.py's meshes)
        self.dp_rank, self.dp_world = self.rank // cfg.model_parallel, self.world // cfg.model_parallel
        self.order = GlobalOrder(len(self.source), cfg.seed, cfg.global_batch_size, cfg.micro_batch_size,
                                 self.dp_world)
        from llmpipe.training.model import tokenizer_token_ids

        tok_dir = self.spec.get("tokenizer_dir")  # the special ids the model is built with
        model, attn = build_model(cfg, int(self.spec["vocab_size"]), self.device,
                                  token_ids=tokenizer_token_ids(tok_dir) if tok_dir else None,
                                  meta=self.meta_init())
        self.model_config = model.config
        self.attn = attn
        if self.rank == 0:
            log.info("model: %s params, attention=%s, strategy=%s, world=%d, tensor=%d, pipeline=%d, accum=%d, "
                     "device=%s",
                     f"{sum(p.numel() for p in model.parameters()):,}", attn, cfg.strategy, self.world,
                     cfg.parallel.tensor, cfg.parallel.pipeline, self.order.accum, self.device)
        ds = deepspeed_config(cfg, self.world, Path(self.spec.get("base_dir", ".")), self.device.type == "cuda") \
            if cfg.strategy == "deepspeed" else None
        if cfg.parallel.pipeline > 1:  # its own step (pipeline_step): the schedule owns the micro-batches
            from llmpipe.training.pipeline import PipelineEngine

            self.engine = PipelineEngine(model, cfg, self.device, self.order.accum)
        else:
            self.engine = make_engine(model, cfg, self.device, ds)
        self.fpt = flops_per_token(self.model_config, self.seq_len)
        self.peak = device_peak_flops(self.device, cfg.launch.peak_tflops)
        self.step = 0
        self.nonfinite_total = self.nonfinite_streak = self.spikes = 0
        self.overflow_total = self.overflow_streak = 0  # fp16: steps the loss scaler skipped (overflow)
        self.last_loss_scale: float | None = None
        self.loss_ema: float | None = None
        self.loader: Any = None  # the prefetching batch loader while ``run`` trains
        # the save in flight: (hidden folder, final folder, state.json, the write's future or None)
        self.pending_save: tuple[Path, Path, dict[str, Any], Any] | None = None
        self.save_blocked_s = 0.0  # how long the last save_checkpoint held up training
        if cfg.checkpoint.async_save and not self.engine.saves_async and self.rank == 0:
            log.info("train.checkpoint.async_save: the %s engine saves synchronously (asynchronous saves: "
                     "DDP, FSDP2, tensor parallel)", self.engine.name)
        if cfg.eval_every:
            self.eval_source = open_packed(self.spec["data_dir"], cfg.eval_split)
            table = self.spec.get("token_bytes")  # UTF-8 bytes per token id (the stage writes it)
            self.token_bytes = torch.as_tensor(np.load(table), device=self.device) if table else None
        torch.manual_seed(cfg.seed + self.dp_rank)  # one stream per replica: a tensor group draws alike

    def meta_init(self) -> bool:
        """Build the model on the meta device when an engine shards it (FSDP2, tensor parallel) and it is
        freshly seeded: each rank then allocates only its shards (``model.materialize``), never the
        whole model. DDP and DeepSpeed hold it whole anyway; pipeline stages cut it first."""
        cfg = self.cfg
        return (cfg.strategy == "fsdp2" or cfg.parallel.tensor > 1) and cfg.parallel.pipeline == 1 \
            and not cfg.model.init_from

    # -- checkpoints ---------------------------------------------------------------------------------
    def layout(self) -> Any:
        """How this run writes its checkpoints (``resume.py``)."""
        from llmpipe.training.resume import CheckpointLayout

        return CheckpointLayout.of(self.engine, self.cfg, self.world)

    def latest_checkpoint(self) -> Path | None:
        done = sorted(p for p in self.ckpt_root.glob("step_*") if (p / "state.json").exists())
        return done[-1] if done else None

    def save_checkpoint(self) -> Path:
        """Save this step's state into a hidden folder that becomes ``step_<n>`` once complete.

        ``train.checkpoint.async_save`` on a DCP engine: this returns once the state is staged and
        the write goes on behind the next steps; the checkpoint is committed (``state.json``, written
        last, then the rename) by :meth:`poll_save` once every rank's write finished, so a run killed
        meanwhile resumes from the previous complete one. At most one save is in flight: a new one
        first finishes the last.
        """
        import numpy as np
        import torch

        self.finish_save()
        t0 = time.perf_counter()
        final = self.ckpt_root / f"step_{self.step:08d}"
        tmp = self.ckpt_root / f".tmp-step_{self.step:08d}"
        if self.rank == 0:  # a hidden folder left by a killed run never became a checkpoint
            for stale in self.ckpt_root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        future = self.engine.save_async(tmp) if self.cfg.checkpoint.async_save else self.engine.save(tmp)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, tmp / f"rng_rank{self.rank}.pt")
        state = {"step": self.step, "samples": self.step * self.cfg.global_batch_size,
                 "nonfinite_total": self.nonfinite_total, "nonfinite_streak": self.nonfinite_streak,
                 "spikes": self.spikes, "loss_ema": self.loss_ema, "world": self.world,
                 "overflow_total": self.overflow_total, "overflow_streak": self.overflow_streak,
                 "layout": self.layout().to_json()}  # what a resume checks before it loads
        self.pending_save = (tmp, final, state, future)
        if future is None:
            self.finish_save()
        self.save_blocked_s = time.perf_counter() - t0
        if self.rank == 0:
            log.info("checkpoint step %d: training blocked %.3fs (%s)", self.step, self.save_blocked_s,
                     "async write under way" if future is not None else "written")
        return final

    def poll_save(self) -> None:
        """Commit the save in flight once every rank's write is done (one all-reduce per step while
        one is in flight: the ranks decide together, so they commit at the same step)."""
        if self.pending_save is not None and not self._any(not self.pending_save[3].done()):
            self.finish_save()

    def finish_save(self) -> None:
        """Wait for the save in flight (if any) and commit it: ``state.json`` written last marks it
        complete, then the rename to ``step_<n>`` and pruning to ``train.checkpoint.keep``."""
        if self.pending_save is None:
            return
        tmp, final, state, future = self.pending_save
        self.pending_save = None
        if future is not None:
            future.result()  # raises the write's error, if any, here
        self._barrier()
        if self.rank == 0:
            (tmp / "state.json").write_text(json.dumps(state))  # written last: marks it complete
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            for old in sorted(p for p in self.ckpt_root.glob("step_*"))[: -self.cfg.checkpoint.keep]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint step %d -> %s", state["step"], final.name)
        self._barrier()

    def load_checkpoint(self, path: Path) -> None:
        import numpy as np
        import torch

        from llmpipe.training.resume import CheckpointLayout, check

        state = json.loads((path / "state.json").read_text())
        saved = CheckpointLayout.read(state, path)
        if check(saved, self.layout(), f"{self.ckpt_root.name}/{path.name}") and self.rank == 0:
            log.info("resharding %s through DCP: written by %s on %d ranks (tensor %d), read by %s on %d "
                     "(tensor %d)", path.name, saved.engine, saved.world, saved.tensor, self.engine.name,
                     self.world, self.cfg.parallel.tensor)
        self.engine.load(path)
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.step = int(state["step"])
        self.nonfinite_total = int(state["nonfinite_total"])
        self.nonfinite_streak = int(state["nonfinite_streak"])
        self.spikes = int(state["spikes"])
        self.loss_ema = state["loss_ema"]
        self.overflow_total = int(state.get("overflow_total", 0))
        self.overflow_streak = int(state.get("overflow_streak", 0))
        if self.rank == 0:
            log.info("resumed from %s (step %d, %d samples seen)", path.name, self.step, state["samples"])

    # -- the loop --------------------------------------------------------------------------------------
    def step_batches(self, step: int) -> list[Any]:
        """This rank's micro-batches of ``step`` on the CPU: (ids, targets, entity mask or None) each; a
        pipeline engine gets the step's micro-batches as one batch (its schedule splits them)."""
        from llmpipe.training.data import batch, entity_batch

        accum = range(self.order.accum)
        if hasattr(self.engine, "train_batch"):
            idx = [i for a in accum for i in self.order.indices(step, a, self.dp_rank)]
            return [(*batch(self.source, idx, self.seq_len), None)]
        out = []
        for a in accum:
            idx = self.order.indices(step, a, self.dp_rank)
            entity = (entity_batch(self.source, idx, self.seq_len)
                      if self.cfg.loss.entity_weight is not None else None)
            out.append((*batch(self.source, idx, self.seq_len), entity))
        return out

    def next_batches(self) -> tuple[list[Any], float]:
        """The micro-batches of ``self.step`` on the device and the seconds waited for them: from the
        prefetching loader inside ``run``, else built now (the LR finder and tests step by hand)."""
        if self.loader is not None:
            return self.loader.get(self.step)
        from llmpipe.training.data import BatchLoader

        return BatchLoader(self.step_batches, self.device, self.step, self.step + 1, depth=0).get(self.step)

    def train_step(self) -> dict[str, Any]:
        eng = self.engine
        if hasattr(eng, "train_batch"):
            return self.pipeline_step()
        t0 = time.perf_counter()
        lr = self.learning_rate(self.step)
        micro, data_s = self.next_batches()
        # Every engine backpropagates every micro-batch's loss as it is and decides once per step: a
        # non-finite loss only spoils the gradients of a step that is skipped whole. DeepSpeed applies
        # its optimizer inside the last backward, so it gets the learning rate first and skips a step
        # with non-finite gradients itself (its overflow check, ``was_step_applied``).
        eng.start_step(lr)
        loss_sum: Any = None
        for a, (ids, targets, entity) in enumerate(micro):
            with eng.sync_context(a == len(micro) - 1):
                loss, _ = self.forward(ids, targets, entity)
                eng.backward(loss, self.order.accum)
            value = loss.detach().double()  # summed in order on the device, as Python sums floats
            loss_sum = value if loss_sum is None else loss_sum + value
        total = float(loss_sum)  # the one host sync of the step's losses
        bad_step = self._any(not math.isfinite(total))
        grad_norm = eng.step(lr, skip=bad_step)
        loss_mean = float("nan") if bad_step else self._mean(total / len(micro))
        dt = time.perf_counter() - t0
        rec = self._account(loss_mean, lr, grad_norm, bad_step, dt)
        rec.update(data_wait_s=data_s, data_wait_share=data_s / dt)  # waiting for data: the loader is slow
        return rec

    def pipeline_step(self) -> dict[str, Any]:
        """One step of a pipeline engine: the schedule runs every micro-batch of the step at once, so
        the per-micro-batch ``forward`` hook is not called; a non-finite loss skips the step."""
        t0 = time.perf_counter()
        lr = self.learning_rate(self.step)
        ((ids, targets, _),), data_s = self.next_batches()
        loss = self.engine.train_batch(ids, targets)
        bad = not math.isfinite(loss)  # the same value on every rank (the replicas' last stages' mean)
        grad_norm = self.engine.step(lr, skip=bad)
        dt = time.perf_counter() - t0
        rec = self._account(float("nan") if bad else loss, lr, grad_norm, bad, dt)
        rec.update(data_wait_s=data_s, data_wait_share=data_s / dt)
        return rec

    def evaluate(self) -> dict[str, float]:
        """Validation loss (nats per token) and bits per byte on the fixed held-out slice: the first
        ``eval_sequences`` of ``eval_split``, each replica scoring its share in micro-batches, summed
        over the replicas (a collective: every rank calls it). No gradients, no optimizer, no RNG:
        the training that follows is the same as without it."""
        import torch

        from llmpipe.training.data import batch

        mb, dp, n = self.cfg.micro_batch_size, self.dp_world, len(self.eval_source)
        batches = max(1, min(self.cfg.eval_sequences, n) // (mb * dp))
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # nll, targets, bytes
        with torch.no_grad():
            for k in range(batches):
                idx = [((k * dp + self.dp_rank) * mb + j) % n for j in range(mb)]
                ids, targets = (t.to(self.device) for t in batch(self.eval_source, idx, self.seq_len))
                _, logits = self.engine.forward(ids, targets)
                flat = targets.reshape(-1)
                keep = flat != -100
                nll = torch.nn.functional.cross_entropy(logits.float().reshape(flat.numel(), -1), flat,
                                                        ignore_index=-100, reduction="none")
                sums[0] += nll[keep].double().sum()
                sums[1] += keep.sum()
                if self.token_bytes is not None:
                    sums[2] += self.token_bytes[flat[keep]].sum()
        if self.dist is not None:
            self.dist.all_reduce(sums)  # the ranks of one replica (tensor parallel) scored the same batches
            sums /= self.cfg.model_parallel
        nll, count, size = (float(x) for x in sums)
        out = {"val_loss": nll / count}
        if self.token_bytes is not None and size > 0:
            out["val_bpb"] = nll / (math.log(2) * size)
        return out

    def learning_rate(self, step: int) -> float:
        """The learning rate of ``step``: the configured schedule (the LR finder sweeps its own)."""
        return lr_at(step, self.cfg)

    def forward(self, ids: Any, targets: Any, entity: Any = None) -> tuple[Any, Any]:
        """(loss, logits) of one micro-batch (``entity``: the targets' entity mask when the entity loss
        is on); a subclass may change the loss (tests inject faults)."""
        return self.engine.forward(ids, targets, entity)

    def _account(self, loss: float, lr: float, grad_norm: float, bad: bool, dt: float) -> dict[str, Any]:
        cfg, guards = self.cfg, self.cfg.guards
        if bad:
            self.nonfinite_total += 1
            self.nonfinite_streak += 1
            if self.rank == 0:
                log.warning("step %d: non-finite loss, step skipped (%d in a row)", self.step,
                            self.nonfinite_streak)
            if self.nonfinite_streak >= guards.max_consecutive_nonfinite:
                raise RuntimeError(
                    f"training aborted: the loss was non-finite for {self.nonfinite_streak} steps in a row "
                    f"(steps {self.step - self.nonfinite_streak + 2}..{self.step + 1}; "
                    f"train.guards.max_consecutive_nonfinite={guards.max_consecutive_nonfinite}); lower "
                    "train.optimizer.lr, keep train.optimizer.grad_clip > 0, or check the data")
        else:
            self.nonfinite_streak = 0
            if self.loss_ema is not None and self.step >= cfg.schedule.warmup_steps \
                    and loss > guards.spike_factor * self.loss_ema:
                self.spikes += 1
                if self.rank == 0:
                    log.warning("step %d: loss spike %.4f > %.1f x running mean %.4f", self.step, loss,
                                guards.spike_factor, self.loss_ema)
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        tokens = cfg.global_batch_size * self.seq_len
        tps = tokens / dt
        rec = {"step": self.step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tps, "flops_per_s": tps * self.fpt,
               "mfu": (tps * self.fpt / (self.peak * self.world)) if self.peak else None,
               "peak_mem_mb": _peak_mem_mb(self.device), "step_time_s": dt, "skipped": bad,
               "tokens": (self.step + 1) * tokens}
        if self.device.type == "cuda":
            import torch

            rec["reserved_mb"] = torch.cuda.memory_reserved(self.device) / 2**20  # the caching allocator's
        scale = self.engine.loss_scale()
        if scale is not None:
            rec.update(loss_scale=scale, overflow_skipped=self._watch_loss_scale(scale))
        return rec

    def _watch_loss_scale(self, scale: float) -> bool:
        """fp16: count the steps the loss scaler skipped (inf/NaN gradients: it lowers the scale) and warn
        when the scale falls below ``guards.loss_scale_floor`` or ``guards.overflow_skips_warn`` steps in
        a row were skipped: mixed precision has stopped training. Returns whether this step was skipped."""
        guards, over = self.cfg.guards, bool(self.engine.overflowed)
        self.overflow_total += over
        self.overflow_streak = self.overflow_streak + 1 if over else 0
        prev, self.last_loss_scale = self.last_loss_scale, scale
        if self.rank != 0:
            return over
        if over:
            log.info("step %d: fp16 gradient overflow, step skipped by the loss scaler (scale now %g)",
                     self.step + 1, scale)
        if over and self.overflow_streak == guards.overflow_skips_warn:
            log.warning("step %d: the fp16 loss scaler skipped %d steps in a row (scale now %g; "
                        "train.guards.overflow_skips_warn): the gradients overflow at every step, the model "
                        "does not train; check that scaler.update() runs, lower train.optimizer.lr, or use bf16",
                        self.step + 1, self.overflow_streak, scale)
        if scale < guards.loss_scale_floor and (prev is None or prev >= guards.loss_scale_floor):
            log.warning("step %d: the fp16 loss scale fell to %g, below train.guards.loss_scale_floor (%g): "
                        "small gradients underflow in fp16 now; lower train.optimizer.lr, check the data, or "
                        "use bf16", self.step + 1, scale, guards.loss_scale_floor)
        return over

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.setup()
        latest = self.latest_checkpoint() if cfg.checkpoint.resume else None
        if latest is not None:
            self.load_checkpoint(latest)
        metrics_path = self.run_dir / "metrics.jsonl"
        if self.rank == 0:
            self._truncate_metrics(metrics_path)
        from llmpipe.training.data import BatchLoader
        from llmpipe.training.watch import RunWatch

        watch = RunWatch(cfg, self.device, self.run_dir, self.rank)
        self.loader = BatchLoader(self.step_batches, self.device, self.step, cfg.max_steps, cfg.launch.prefetch)
        try:
            self._loop(metrics_path, watch)
        finally:
            self.loader.close()
            self.loader = None
        watch.close()
        self.save_checkpoint()
        self.finish_save()  # the final checkpoint and every earlier one are complete before the export
        self.export()
        import torch

        # CPU kernels split their float reductions by thread count: the bits of the weights (and so
        # the stage's bytes for one key) are the same only at the same threads per process
        scale = self.engine.loss_scale()
        fp16 = {"overflow_skipped_steps": self.overflow_total, "loss_scale": scale} if scale is not None else {}
        summary = {"steps": self.step, "nonfinite_steps": self.nonfinite_total, "loss_spikes": self.spikes, **fp16,
                   "attention": self.attn, "world_size": self.world, "threads_per_process": torch.get_num_threads(),
                   **({"engine": self.engine.name} if self.cfg.model_parallel > 1 else {})}
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(summary))
        return summary

    def _loop(self, metrics_path: Path, watch: Any) -> None:
        cfg = self.cfg
        while self.step < cfg.max_steps:
            with watch.step(self.step):
                rec = self.train_step()
            self.poll_save()
            if cfg.eval_every and (rec["step"] % cfg.eval_every == 0 or rec["step"] == cfg.max_steps):
                rec.update(self.evaluate())
            rec["memory_mb"] = watch.after_step(rec)
            self.step += 1
            if self.rank == 0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    print(METRIC_PREFIX + json.dumps(rec), flush=True)
                    log.info("step %d/%d loss %.4f lr %.2e gnorm %.3f tok/s %.0f data-wait %.0f%%%s", self.step,
                             cfg.max_steps, rec["loss"], rec["lr"], rec["grad_norm"], rec["tokens_per_s"],
                             100 * rec["data_wait_share"],
                             f" val loss {rec['val_loss']:.4f}" if "val_loss" in rec else "")
            every = cfg.checkpoint.every
            if every and self.step % every == 0 and self.step < cfg.max_steps:
                self.save_checkpoint()

    def _truncate_metrics(self, path: Path) -> None:
        """On resume, drop records past the checkpoint so the curve has each step exactly once."""
        if not path.exists():
            return
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= self.step]
        path.write_text("".join(ln + "\n" for ln in keep))

    def export(self) -> None:
        """Rank 0 writes ``save_pretrained`` (safetensors) of the full weights into ``export_dir``, ready
        for inference (``ready_for_inference``: the tokenizer's special ids, the KV cache on), with the
        tokenizer whose ``model_max_length`` is the model's positions (``spec["tokenizer_dir"]``)."""
        from transformers import AutoModelForCausalLM

        from llmpipe.training.model import ready_for_inference, tokenizer_token_ids

        sd = self.engine.full_state_dict()
        if self.rank == 0:
            out = Path(self.spec["export_dir"])
            out.mkdir(parents=True, exist_ok=True)
            model = AutoModelForCausalLM.from_config(self.model_config, attn_implementation="sdpa")
            missing, unexpected = model.load_state_dict(sd, strict=False)
            if missing or unexpected:
                raise RuntimeError(f"export: state dict mismatch (missing {missing[:5]}, unexpected {unexpected[:5]})")
            tok_dir = self.spec.get("tokenizer_dir")
            ready_for_inference(model, tokenizer_token_ids(tok_dir) if tok_dir else None)
            model.save_pretrained(out, safe_serialization=True)
            if tok_dir:
                from llmpipe.tokenization.tokenizer import save_for_model

                save_for_model(tok_dir, out, model.config.max_position_embeddings)
            log.info("exported model to %s", out)
        self._barrier()


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("DeepSpeed", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None, trainer: type[Trainer] = Trainer) -> int:
    """One worker: read the spec, train, report a failure per rank. ``trainer``: a subclass to run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="worker spec JSON written by llmpipe.training.launch")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.config).read_text())
    rank = int(os.environ.get("RANK", 0))
    _setup_logging(rank)
    err_dir = Path(spec["run_dir"]) / "errors"
    err_dir.mkdir(parents=True, exist_ok=True)
    _record_fatal_signals(err_dir / f"rank_{rank}{FATAL_SUFFIX}")
    try:
        trainer(spec).run()
    except BaseException as e:  # report which rank failed and why, then let torchrun see the failure
        (err_dir / f"rank_{rank}.json").write_text(json.dumps({
            "rank": rank, "time": time.time(), "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()}))
        log.error("rank %d failed: %s: %s", rank, type(e).__name__, e)
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
    return 0


FATAL_SUFFIX = ".fatal"


def _record_fatal_signals(path: Path) -> None:
    """Dump every thread's Python stack to ``path`` if this worker dies of SIGSEGV, SIGABRT, SIGBUS,
    SIGFPE or SIGILL (a C++ exception nobody caught, a crash in a kernel): the Python-level
    exception handler never runs then, and the launcher can name only the signal.
    ``launch.describe_failure`` reads the file back. It stays open, and the handler on, until the
    process is gone: a crash while the interpreter shuts down (a thread still in a kernel, a C++
    destructor) is recorded too. The launcher removes the files that stayed empty."""
    fh = open(path, "w")  # noqa: SIM115 - faulthandler writes to it from a signal handler, at any time
    faulthandler.enable(file=fh, all_threads=True)
    _FATAL_FILES.append(fh)  # the module keeps it referenced: a closed file would silence the handler


_FATAL_FILES: list[Any] = []


def run_worker(trainer: type[Trainer] = Trainer) -> None:
    """The ``python -m`` entry of a worker: train, then end the process at once when it succeeded.

    A worker that returned from training ends with ``os._exit`` after flushing its output, as a
    ``multiprocessing`` child does, instead of through interpreter finalization. Why: gloo's worker
    threads destroy a finished collective's work object some time after ``wait()`` returned, and
    that object can hold the last reference to a tensor whose Python object it owns; destroying it
    takes the GIL. When the main thread has already begun finalizing (it has nothing left to do),
    the thread taking the GIL is ended by CPython inside a destructor, ``std::terminate`` runs,
    and the worker dies of SIGABRT ("terminate called without an active exception") after a
    complete, correct run. We saw it about once in 30 two-rank runs when two trainings shared the
    2 cores; the core dump shows ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` ->
    ``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
    ``PyThread_exit_thread``. ``destroy_process_group`` does not join those threads while a DDP
    reducer still holds the group. A failed worker raises on the usual path, so its traceback is
    printed and torchrun's error file written.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    code = record(lambda: main(trainer=trainer))()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run_worker()
