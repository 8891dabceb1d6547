"""Trainer overhead and DDP scaling on this machine (CPU, fp32).

1. Our trainer (``llmpipe.training.trainer.Trainer``, one process, its whole ``run()`` loop with the
   per-step signals on: data-wait, memory sample, leak watch, TensorBoard events, metrics.jsonl) vs a
   minimal hand-written torch loop (forward, backward, clip, AdamW step) on the same model, batches,
   sequence length, dtype and thread count. Goal: tokens/s ratio >= 0.95.
   The two sides alternate step by step inside one run (a hand step, then a trainer step), so a
   neighbour's burst on a shared machine slows both alike; a trainer step lasts from its start to
   the next hand step's start, so its bookkeeping between steps counts; the first ``--warmup``
   steps of every run are left out. The ratio is the median over all steps; the spread of the
   per-round medians is printed. Runs with ``train.watch.tensorboard: false`` and the leak watch off
   alternate with the default ones and price the watch. One thread per side by default.
2. The same trainer under torchrun: 2 processes (DDP, 1 thread each) vs 1 process (2 threads).

Why an earlier version printed 0.865 where a note had 1.13 (and 14.6 once here): it timed one
whole run per side, one after the other, on 2 shared cores with 2 threads per side. A thread team
on busy cores waits at every op for whichever thread the scheduler parked: single steps became
5-10x slower at random, so a run's speed depended on what the neighbours did during it, far more
than on the 5% measured. Interleaved whole runs still varied 3x per run; alternating single steps
and one thread make the comparison hold on a busy machine.

Usage: python benchmarks/train_throughput.py [--steps 16] [--warmup 3] [--rounds 4] [--hidden 256]
       [--layers 4] [--seq 128] [--threads N] [--skip-ddp]
"""

from __future__ import annotations

import os
import sys

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from llmpipe.training.config import TrainConfig  # noqa: E402
from llmpipe.training.data import GlobalOrder, batch, open_packed, write_npy_fixture  # noqa: E402
from llmpipe.training.launch import launch  # noqa: E402
from llmpipe.training.trainer import Trainer  # noqa: E402

VOCAB = 2048


def make_cfg(args: argparse.Namespace, watch: bool = True, **launch: object) -> TrainConfig:
    """The benchmark's ``train:`` section; ``launch`` adds to its ``train.launch`` settings."""
    return TrainConfig(model={"overrides": {"hidden_size": args.hidden, "intermediate_size": args.hidden * 3,
                                            "num_hidden_layers": args.layers, "num_attention_heads": 4,
                                            "num_key_value_heads": 4}},
                       max_steps=args.steps, global_batch_size=8, micro_batch_size=4,
                       optimizer={"lr": 1e-3}, schedule={"warmup_steps": 1}, checkpoint={"every": 0},
                       watch={"tensorboard": watch, "leak_window": 20 if watch else 0},
                       launch={"nproc_per_node": 1, "timeout_s": 1800, **launch})


def steady(rates: list[float]) -> float:
    return statistics.median(rates[2:] if len(rates) > 4 else rates)


class HandLoop:
    """The hand-written loop (forward, backward, clip, AdamW), one step per call."""

    def __init__(self, cfg: TrainConfig, data: Path, seq: int) -> None:
        from transformers import LlamaForCausalLM

        from llmpipe.training.model import llama_config

        conf = llama_config("tiny", VOCAB, cfg.model.overrides)
        conf._attn_implementation = "sdpa"
        torch.manual_seed(cfg.seed)
        self.model = LlamaForCausalLM(conf)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.optimizer.lr,
                                     weight_decay=cfg.optimizer.weight_decay)
        self.src = open_packed(data)
        self.order = GlobalOrder(len(self.src), cfg.seed, cfg.global_batch_size, cfg.micro_batch_size, 1)
        self.cfg, self.seq, self.step_no = cfg, seq, 0

    def step(self) -> None:
        for a in range(self.order.accum):
            ids, targets = batch(self.src, self.order.indices(self.step_no, a, 0), self.seq)
            logits = self.model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
            (loss / self.order.accum).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1


class PairedTrainer(Trainer):
    """Our trainer, unchanged, with one hand-loop step run just before each of its steps.

    The two sides alternate step by step in one process, so a neighbour's burst on a shared machine
    hits both alike. A trainer step is timed from its start to the start of the next hand step, so
    what ``run()`` does between steps (metrics.jsonl, memory sample, leak watch, TensorBoard) counts.
    """

    def setup(self) -> None:
        super().setup()
        self.hand = HandLoop(self.cfg, Path(self.spec["data_dir"]), self.seq_len)
        self.marks: list[tuple[float, float]] = []  # (hand step start, trainer step start)

    def train_step(self) -> dict[str, object]:
        h0 = time.perf_counter()
        self.hand.step()
        self.marks.append((h0, time.perf_counter()))
        return super().train_step()


def paired_run(cfg: TrainConfig, data: Path, root: Path, seq: int, warmup: int) -> list[tuple[float, float]]:
    """(hand seconds, trainer seconds) per step past the warm-up; setup, save and export not timed."""
    spec = {"train": cfg.model_dump(mode="json"), "data_dir": str(data), "seq_len": seq, "vocab_size": VOCAB,
            "checkpoint_dir": str(root / "ckpt"), "export_dir": str(root / "export"), "run_dir": str(root)}
    tr = PairedTrainer(spec)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # its per-step metric lines
        tr.run()
    m = tr.marks  # the last trainer step has no next mark: it ends at run()'s save, left out
    return [(b[1] - b[0], c[0] - b[1]) for b, c in zip(m, m[1:], strict=False)][warmup:]


def rounds(args: argparse.Namespace, data: Path, root: Path) -> dict[str, list[list[tuple[float, float]]]]:
    """Paired runs with the watch on and off, alternating, ``args.rounds`` of each."""
    out: dict[str, list[list[tuple[float, float]]]] = {"watch_on": [], "watch_off": []}
    paired_run(make_cfg(args), data, root / "warm", args.seq, args.warmup)  # imports, allocator: not counted
    for r in range(args.rounds):
        for name in (("watch_on", "watch_off") if r % 2 == 0 else ("watch_off", "watch_on")):
            cfg = make_cfg(args, watch=name == "watch_on")
            out[name].append(paired_run(cfg, data, root / f"{name}{r}", args.seq, args.warmup))
    return out


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


def launched(cfg: TrainConfig, data: Path, root: Path, seq: int) -> float:
    spec = {"train": cfg.model_dump(mode="json"), "data_dir": str(data), "seq_len": seq, "vocab_size": VOCAB,
            "checkpoint_dir": str(root / "ckpt"), "export_dir": str(root / "export")}
    res = launch(cfg.launch, spec, root)
    return steady([r["tokens_per_s"] for r in res.metrics])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16, help="steps per run (each side, each round)")
    ap.add_argument("--warmup", type=int, default=3, help="steps of each run left out of the timing")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, each a run with the watch on and one off")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of part 1, both sides (0: this "
                    "process's cores; part 2 always uses them all)")
    ap.add_argument("--skip-ddp", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds, args.hidden, args.layers, args.seq = 8, 1, 1, 64, 2, 32
        args.skip_ddp = True  # part 1 only: the torchrun part starts worker processes for minutes
    if args.steps < args.warmup + 6:  # the last step has no next start: it is not timed
        ap.error(f"--steps ({args.steps}) must leave at least 5 timed steps after --warmup ({args.warmup})")
    cores = len(os.sched_getaffinity(0))  # cpu_count() counts the host's cores, not this process's
    # One thread by default: on shared cores a thread team waits at every op for whichever thread the
    # scheduler parked, which made single steps 5-10x slower at random and swamped the 5% measured here
    threads = args.threads or cores
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the trainer sets its threads from it: both sides equal
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_npy_fixture(root / "data", n=256, seq_len=args.seq, vocab_size=VOCAB)
        runs = rounds(args, data, root)
        tok = 8 * args.seq  # global batch x seq per step
        per_round = {k: [statistics.median(h / t for h, t in run) for run in v] for k, v in runs.items()}
        ratio = statistics.median(h / t for run in runs["watch_on"] for h, t in run)
        print(f"single process, {threads} thread(s), {args.rounds} rounds x {args.steps} steps per setting, hand "
              f"and trainer steps alternating ({args.warmup} warm-up steps left out each run):")
        for k, v in runs.items():
            hand = statistics.median(h for run in v for h, _ in run)
            ours = statistics.median(t for run in v for _, t in run)
            print(f"  {k:9s}: hand loop {tok / hand:.0f} tok/s, trainer {tok / ours:.0f} tok/s (medians); "
                  f"trainer/hand per round {spread(per_round[k])}")
        off = statistics.median(h / t for run in runs["watch_off"] for h, t in run)
        print(f"  trainer/hand over all steps: watch on {ratio:.3f}, off {off:.3f}: the watch (TensorBoard + "
              f"leak watch) costs {100 * (1 - ratio / off):.1f}% of the trainer's throughput")
        if not args.skip_ddp:
            one = launched(make_cfg(args, nproc_per_node=1, threads_per_process=cores), data, root / "p1",
                           args.seq)
            two = launched(make_cfg(args, nproc_per_node=2, threads_per_process=max(1, cores // 2)), data,
                           root / "p2", args.seq)
            print(f"torchrun DDP: 1 process {one:.0f} tok/s, 2 processes {two:.0f} tok/s, "
                  f"scaling {two / one:.3f} (same {cores} cores)")
    print(f"RESULT trainer_vs_torch_loop_tokens_per_s {ratio:.3f} goal >= 0.95")


if __name__ == "__main__":
    main()
