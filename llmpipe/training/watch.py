"""What a training run reports about itself beyond the loss: memory growth, a profiler trace, TensorBoard.

The field guides' troubleshooting lists "memory leak: graphs accumulated in a loop, DataLoader workers
that do not exit; check ``torch.cuda.memory_summary()``" and "find the bottleneck with
``torch.profiler``". :class:`RunWatch` does both for every run (rank 0): it samples memory after each
step (allocated GPU memory, or the process RSS on CPU), warns once when it grew at nearly every step of
the last ``train.watch.leak_window`` steps by more than ``leak_min_mb`` in all, with the memory
summary in the run log; it traces the steps ``train.profile.steps`` names with ``torch.profiler``
into ``<run>/profile/`` (Chrome trace JSON, which TensorBoard's profiler plugin and Perfetto open);
and it writes TensorBoard event files into ``<run>/tensorboard/`` beside ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("llmpipe.training.watch")
RISING_SHARE = 0.8  # a leak: memory rose at this share of the window's steps (or more)


def memory_mb(device: Any) -> float:
    """Memory in use now: allocated CUDA memory, or this process's resident set on CPU."""
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def memory_report(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.memory_summary(device, abbreviated=True)
    import psutil

    info = psutil.Process().memory_full_info()
    return f"process memory: rss {info.rss / 2**20:.1f} MiB, uss {info.uss / 2**20:.1f} MiB, vms {info.vms / 2**20:.1f} MiB"


class LeakWatch:
    """Warns once when memory grew at nearly every step of a window, by more than ``min_mb`` in all."""

    def __init__(self, window: int, min_mb: float) -> None:
        self.window, self.min_mb = window, min_mb
        self.samples: deque[float] = deque(maxlen=window + 1)
        self.reported = False

    def add(self, mb: float) -> str | None:
        """The warning text the first time the window looks like a leak, else None."""
        if self.window <= 0 or self.reported:
            return None
        self.samples.append(mb)
        if len(self.samples) <= self.window:
            return None
        values = list(self.samples)
        rises = sum(b > a for a, b in zip(values, values[1:], strict=False))
        growth = values[-1] - values[0]
        if rises >= RISING_SHARE * self.window and growth > self.min_mb:
            self.reported = True
            return (f"memory grew at {rises} of the last {self.window} steps, by {growth:.1f} MiB "
                    f"({values[0]:.1f} -> {values[-1]:.1f} MiB): a leak? (tensors kept across steps, e.g. "
                    f"appending the loss instead of loss.item(); train.watch.leak_window)")
        return None


class RunWatch:
    """Rank 0's watch over a run: leak warnings, profiler traces, TensorBoard scalars."""

    def __init__(self, cfg: Any, device: Any, run_dir: Path, rank: int) -> None:
        self.cfg, self.device, self.run_dir, self.rank = cfg, device, Path(run_dir), rank
        self.leaks = LeakWatch(cfg.watch.leak_window, cfg.watch.leak_min_mb)
        self.profile_steps = sorted(set(cfg.profile.steps))
        self.writer = self._tensorboard() if rank == 0 and cfg.watch.tensorboard else None

    def _tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package ([train] installs it)
            log.warning("train.watch.tensorboard: the tensorboard package is not installed; no event files "
                        "(pip install 'llmpipe[train]')")
            return None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step (0-based): traced by torch.profiler when ``train.profile`` names it."""
        if step + 1 not in self.profile_steps:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        out = self.run_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"trace_rank{self.rank}_step{step + 1:06d}.json"))
        if self.rank == 0:
            log.info("profiled step %d -> %s; top operators:\n%s", step + 1, out,
                     prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))

    def after_step(self, rec: dict[str, Any]) -> float:
        """Sample memory, warn on a leak, write the scalars; returns the memory sample (MiB)."""
        mb = memory_mb(self.device)
        if self.rank != 0:
            return mb
        warning = self.leaks.add(mb)
        if warning is not None:
            log.warning("step %d: %s\n%s", rec["step"], warning, memory_report(self.device))
        if self.writer is not None:
            for name in ("loss", "lr", "grad_norm", "tokens_per_s", "data_wait_share", "mfu", "loss_scale",
                         "val_loss", "val_bpb"):
                value = rec.get(name)
                if isinstance(value, (int, float)) and value == value:  # not None, not NaN
                    self.writer.add_scalar(f"train/{name}", value, rec["step"])
            self.writer.add_scalar("train/memory_mb", mb, rec["step"])
        return mb

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
