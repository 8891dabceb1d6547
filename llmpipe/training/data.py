"""Packed training sequences and a deterministic, resumable global order.

The order of samples is a function of (seed, global sample index) only: epoch ``e`` is a seeded
permutation of all sequences, and optimizer step ``s`` consumes global samples
``[s*G, (s+1)*G)``. Rank ``r`` takes micro-batch ``a`` of that step as the slice
``(a*world + r)*mb : +mb``. So the data position to checkpoint is just the step number, and the same
global batch is seen whatever the world size (1 node x 2 processes == 2 nodes x 1 process).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from llmpipe.tokenization.layout import TOKENIZE


class PackedSource(Protocol):
    seq_len: int

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Any: ...


class NpyPacked:
    """Fixture reader: ``<dir>/<split>/*.npy`` 2-D token arrays [n, seq_len + 1] (memory-mapped).

    Same convention as the tokenize stage's ``PackedDataset``: a row holds ``seq_len + 1`` ids, the
    inputs are ``row[:-1]`` and the targets ``row[1:]``.
    """

    def __init__(self, artifact_dir: str | Path, split: str = "train") -> None:
        root = Path(artifact_dir) / split
        self.files = sorted(root.glob("*.npy"))
        if not self.files:
            raise FileNotFoundError(f"train.split: no packed shards (*.npy) under {root}")
        self.arrays = [np.load(f, mmap_mode="r") for f in self.files]
        lens = {a.shape[1] for a in self.arrays}
        if len(lens) != 1:
            raise ValueError(f"packed shards under {root} disagree on sequence length: {sorted(lens)}")
        self.seq_len = lens.pop() - 1
        self.offsets = np.cumsum([0] + [a.shape[0] for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        f = int(np.searchsorted(self.offsets, i, side="right") - 1)
        row = torch.tensor(np.asarray(self.arrays[f][i - self.offsets[f]]), dtype=torch.long)
        return row[:-1], row[1:]


def open_packed(artifact_dir: str | Path, split: str = "train") -> PackedSource:
    """The tokenize stage's packed dataset; the npy layout when that module is not installed."""
    if list((Path(artifact_dir) / split).glob("*.npy")):
        return NpyPacked(artifact_dir, split)
    try:
        from llmpipe.tokenization.dataset import PackedDataset  # type: ignore[import-not-found]
    except ImportError:
        return NpyPacked(artifact_dir, split)  # raises a clear "no packed shards" error
    if not (Path(artifact_dir) / TOKENIZE.index).is_file():
        raise FileNotFoundError(f"no packed shards: {artifact_dir} has neither index.json nor {split}/*.npy")
    try:
        return PackedDataset(artifact_dir, split, pairs=True)
    except ValueError as e:  # unknown split
        raise FileNotFoundError(str(e)) from None


def write_npy_fixture(out_dir: str | Path, n: int, seq_len: int, vocab_size: int, seed: int = 0,
                      shards: int = 2, split: str = "train") -> Path:
    """A packed dataset of learnable token sequences (tests, benchmarks): short repeated patterns."""
    rng = np.random.default_rng(seed)
    root = Path(out_dir) / split
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(n):
        period = int(rng.integers(2, 6))
        pat = rng.integers(0, min(vocab_size, 24), size=period)  # a small alphabet: quick to learn
        rows.append(np.resize(pat, seq_len + 1))
    data = np.stack(rows).astype(np.int32)
    for k, part in enumerate(np.array_split(data, shards)):
        np.save(root / f"part-{k:05d}.npy", part)
    (Path(out_dir) / "meta.json").write_text(json.dumps({"seq_len": seq_len, "vocab_size": vocab_size}))
    return Path(out_dir)


@lru_cache(maxsize=4)
def _perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


class GlobalOrder:
    """Which sequences each rank reads at each (step, micro-batch): a pure function of the seed."""

    def __init__(self, n: int, seed: int, global_batch: int, micro_batch: int, world: int) -> None:
        if n <= 0:
            raise ValueError("train: the packed dataset is empty")
        if global_batch % (micro_batch * world):
            raise ValueError(f"global batch {global_batch} not divisible by micro {micro_batch} x world {world}")
        self.n, self.seed, self.g, self.mb, self.world = n, seed, global_batch, micro_batch, world
        self.accum = global_batch // (micro_batch * world)

    def global_index(self, g: int) -> int:
        epoch, pos = divmod(g, self.n)
        return int(_perm(self.n, self.seed, epoch)[pos])

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = step * self.g + (micro * self.world + rank) * self.mb
        return [self.global_index(start + j) for j in range(self.mb)]


def batch(source: PackedSource, idx: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, both [mb, seq_len] int64; padding targets are -100 (ignored by the loss)."""
    pairs = [source[i] for i in idx]
    x = torch.stack([torch.as_tensor(p[0][:seq_len], dtype=torch.long) for p in pairs])
    y = torch.stack([torch.as_tensor(p[1][:seq_len], dtype=torch.long) for p in pairs])
    return x, y


def entity_batch(source: PackedSource, idx: list[int], seq_len: int) -> torch.Tensor:
    """[mb, seq_len] uint8: 1 where a target overlaps an entity span (``tokenize.entity_mask``)."""
    if not hasattr(source, "entity_mask"):
        raise ValueError("train.loss.entity_weight: this packed data has no entity mask")
    return torch.stack([torch.as_tensor(np.asarray(source.entity_mask(i)[:seq_len], dtype=np.uint8))
                        for i in idx])


MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # ids, targets, entity mask or None


class _Failed:
    """What the loader thread hands over instead of a step when assembling it raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class BatchLoader:
    """The micro-batches of each step, assembled ``depth`` steps ahead in a background thread.

    ``make(step)`` builds one step's micro-batches on the CPU (a pure function of the step: the
    global order), so the batches are the same with prefetching on or off. With ``depth > 0`` a
    daemon thread builds steps ``first .. last - 1`` in order into a queue of ``depth`` entries and,
    on CUDA, copies them to the device from pinned memory on a stream of its own while the current
    step computes; the main loop then only waits when the loader fell behind (``get`` returns that
    wait: the data-wait share of the step). ``depth == 0`` builds each step when it is asked for.
    An exception in the thread is raised by ``get`` (the original exception, its traceback from
    the thread). ``close`` stops the thread; it also ends with the process (daemon).
    """

    def __init__(self, make: Callable[[int], list[MicroBatch]], device: torch.device, first: int, last: int,
                 depth: int) -> None:
        self.make, self.device, self.depth = make, device, depth
        self.first, self.next, self.last = first, first, last
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self._cuda and depth > 0 else None
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0 and first < last:
            self._thread = threading.Thread(target=self._work, name="llmpipe-batch-loader", daemon=True)
            self._thread.start()

    def _to_device(self, micro: list[MicroBatch]) -> Any:
        if self._stream is None:  # in the caller's thread: a plain (blocking) copy, as without a loader
            return [tuple(t.to(self.device) if t is not None else None for t in mb) for mb in micro]
        with torch.cuda.stream(self._stream):
            out = [tuple(t.pin_memory().to(self.device, non_blocking=True) if t is not None else None for t in mb)
                   for mb in micro]
            done = torch.cuda.Event()
            done.record(self._stream)
        return out, done

    def _put(self, item: tuple[int, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        step = self.first
        if self._cuda:  # a new thread starts on GPU 0: its copies and stream belong to this rank's device
            torch.cuda.set_device(self.device)
        try:
            for step in range(self.first, self.last):
                if self._stop.is_set() or not self._put((step, self._to_device(self.make(step)))):
                    return
        except BaseException as e:  # handed to the main loop, which raises it
            e.add_note(f"(raised in the batch loader thread while assembling step {step + 1})")
            self._put((step, _Failed(e)))

    def get(self, step: int) -> tuple[list[MicroBatch], float]:
        """The micro-batches of ``step`` on the device, and the seconds spent waiting for them."""
        t0 = time.perf_counter()
        if self._thread is None:
            out = self._to_device(self.make(step))
            self.next = step + 1
            return out, time.perf_counter() - t0
        if step != self.next or step >= self.last:
            raise RuntimeError(f"batch loader: asked for step {step + 1}, it prefetches step {self.next + 1} next "
                               f"(steps {self.first + 1}..{self.last})")
        got, item = self._queue.get()
        self.next = step + 1
        if isinstance(item, _Failed):
            raise item.error
        assert got == step, (got, step)
        if self._stream is not None:
            micro, done = item
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the compute stream waits for the copy, the host does not
            for mb in micro:
                for t in mb:
                    if t is not None:
                        t.record_stream(current)  # the allocator must not reuse it before compute ends
            item = micro
        return item, time.perf_counter() - t0

    def close(self) -> None:
        """Stop the thread (it may be blocked on a full queue) and drop what it prefetched."""
        self._stop.set()
        if self._thread is not None:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=10)
            self._thread = None
