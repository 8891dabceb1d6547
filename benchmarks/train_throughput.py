"""Trainer overhead and DDP scaling on this machine (CPU, fp32).

1. Our trainer (``llmpipe.training.trainer.Trainer``, one process) vs a minimal hand-written torch loop
   (forward, backward, clip, AdamW step) on the same model, batches, sequence length and dtype, in
   one run. Goal: tokens/s ratio >= 0.95.
2. The same trainer under torchrun: 2 processes (DDP, 1 thread each) vs 1 process (2 threads).

Usage: python benchmarks/train_throughput.py [--steps 12] [--hidden 256] [--layers 4] [--seq 128]
"""

from __future__ import annotations

import os
import sys

# benchmarks/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import json  # noqa: E402
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


def make_cfg(args: argparse.Namespace, **launch: object) -> TrainConfig:
    """The benchmark's ``train:`` section; ``launch`` adds to its ``train.launch`` settings."""
    return TrainConfig(model={"overrides": {"hidden_size": args.hidden, "intermediate_size": args.hidden * 3,
                                            "num_hidden_layers": args.layers, "num_attention_heads": 4,
                                            "num_key_value_heads": 4}},
                       max_steps=args.steps, global_batch_size=8, micro_batch_size=4,
                       optimizer={"lr": 1e-3}, schedule={"warmup_steps": 1}, checkpoint={"every": 0},
                       launch={"nproc_per_node": 1, "timeout_s": 1800, **launch})


def steady(rates: list[float]) -> float:
    return statistics.median(rates[2:] if len(rates) > 4 else rates)


def ours(cfg: TrainConfig, data: Path, root: Path, seq: int) -> float:
    spec = {"train": cfg.model_dump(mode="json"), "data_dir": str(data), "seq_len": seq, "vocab_size": VOCAB,
            "checkpoint_dir": str(root / "ckpt"), "export_dir": str(root / "export"), "run_dir": str(root)}
    Trainer(spec).run()
    recs = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    return steady([r["tokens_per_s"] for r in recs])


def hand_loop(cfg: TrainConfig, data: Path, seq: int) -> float:
    from transformers import LlamaForCausalLM

    from llmpipe.training.model import llama_config

    conf = llama_config("tiny", VOCAB, cfg.model.overrides)
    conf._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(conf)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)
    src = open_packed(data)
    order = GlobalOrder(len(src), cfg.seed, cfg.global_batch_size, cfg.micro_batch_size, 1)
    rates = []
    for step in range(cfg.max_steps):
        t0 = time.perf_counter()
        for a in range(order.accum):
            ids, targets = batch(src, order.indices(step, a, 0), seq)
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))
            (loss / order.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rates.append(cfg.global_batch_size * seq / (time.perf_counter() - t0))
    return steady(rates)


def launched(cfg: TrainConfig, data: Path, root: Path, seq: int) -> float:
    spec = {"train": cfg.model_dump(mode="json"), "data_dir": str(data), "seq_len": seq, "vocab_size": VOCAB,
            "checkpoint_dir": str(root / "ckpt"), "export_dir": str(root / "export")}
    res = launch(cfg.launch, spec, root)
    return steady([r["tokens_per_s"] for r in res.metrics])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--skip-ddp", action="store_true")
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_npy_fixture(root / "data", n=256, seq_len=args.seq, vocab_size=VOCAB)
        cfg = make_cfg(args)
        base = hand_loop(cfg, data, args.seq)  # warms up the allocator and kernels for both
        base = hand_loop(cfg, data, args.seq)
        mine = ours(cfg, data, root / "ours", args.seq)
        ratio = mine / base
        print(f"single process, {threads} threads: hand loop {base:.0f} tok/s, trainer {mine:.0f} tok/s, "
              f"ratio {ratio:.3f}")
        if not args.skip_ddp:
            one = launched(make_cfg(args, nproc_per_node=1, threads_per_process=threads), data, root / "p1",
                           args.seq)
            two = launched(make_cfg(args, nproc_per_node=2, threads_per_process=max(1, threads // 2)), data,
                           root / "p2", args.seq)
            print(f"torchrun DDP: 1 process {one:.0f} tok/s, 2 processes {two:.0f} tok/s, "
                  f"scaling {two / one:.3f} (same {threads} cores)")
    print(f"RESULT trainer_vs_torch_loop_tokens_per_s {ratio:.3f} goal >= 0.95")


if __name__ == "__main__":
    main()
