#!/usr/bin/env bash
# Everything the trainer claims about speed on a GPU, in one run on one GPU (under 10 minutes on an
# H100/H200): configs/gpu-125m.yaml and configs/gpu-1b.yaml trained as shipped through the real
# launcher (torchrun, as the pretrain stage starts it: model, strategy, precision, attention,
# torch.compile, micro batch and accumulation per GPU), and for each a bare torch loop on the same GPU
# as the peer (the same model, micro batch, accumulation, dtype, compile, clipping and fused AdamW).
# gpu-1b ships for 8 GPUs with FSDP2: on one GPU it still runs FSDP2 (a one-rank mesh) with the
# accumulation one of its 8 GPUs does; when the planner says a micro batch does not fit this GPU it
# halves it and doubles the accumulation, and says so. Only train.max_steps, the checkpoint cadence
# and log_every (a record per step) come from here.
#
# Prints per preset: tokens/s (trainer and bare), MFU (the trainer's per-step figure against the
# device's peak dense bf16 FLOP/s, llmpipe.training.model.PEAK_FLOPS by exact device name, or
# PEAK_TFLOPS=...), the measured peak memory against the planner's estimate
# (llmpipe.training.strategy.estimate), then
#   RESULT mfu_125m <x> goal >= 0.40
#   RESULT mfu_1b <x> goal >= 0.50
#   RESULT trainer_vs_bare <min over the presets of trainer tok/s / bare tok/s> goal >= 0.95
# Medians over the steps after the compile warm-up (the first third). On a machine without a CUDA
# GPU it refuses with one line and exit code 2.
#
# Usage: bash benchmarks/gpu/run.sh [STEPS]   (env: PRESETS="gpu-125m gpu-1b", PEAK_TFLOPS=989,
#        VERBOSE=1 prints the workers' log, PYTHON=path/to/python, OVERRIDES="train.loss.chunk_tokens=0 ..."
#        config overrides for every preset, applied before the ones above)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
STEPS="${1:-24}" PRESETS="${PRESETS:-gpu-125m gpu-1b}" exec "$PY" - <<'PYEOF'
import json, os, statistics, sys, tempfile, time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    print("benchmarks/gpu/run.sh: no CUDA GPU here (torch.cuda.is_available() is False); nothing measured")
    sys.exit(2)

from llmpipe.config import load_config
from llmpipe.training.data import write_npy_fixture
from llmpipe.training.launch import launch
from llmpipe.training.model import build_model, choose_attention, device_peak_flops, flops_per_token, llama_config
from llmpipe.training.strategy import GB, HEADROOM, Devices, ModelShape, estimate

steps = int(os.environ["STEPS"])
dev = torch.device("cuda:0")
props = torch.cuda.get_device_properties(dev)
override = float(os.environ["PEAK_TFLOPS"]) if os.environ.get("PEAK_TFLOPS") else None
peak = device_peak_flops(dev, override)
print(f"device {props.name}, {props.total_memory / GB:.0f} GiB, peak bf16 "
      f"{peak / 1e12 if peak else 'unknown (set PEAK_TFLOPS)'} TFLOP/s, torch {torch.__version__}", flush=True)


def planned(t, vocab: int, seq: int, micro: int) -> float:
    """The planner's bytes per device for the preset's strategy on this one GPU."""
    shape = ModelShape.of_llama(llama_config(t.model.preset, vocab, t.model.overrides))
    return estimate(shape, Devices(1, 1, props.total_memory), t.strategy, seq_len=seq, micro_batch=micro,
                    precision=t.precision, checkpointing=t.gradient_checkpointing,
                    attention=choose_attention(t.model.attention, dev)).total


def one_gpu(name: str):
    """The preset's train: section on this one GPU: its per-GPU micro batch and accumulation."""
    cfg = load_config(Path("configs") / f"{name}.yaml", os.environ.get("OVERRIDES", "").split() + [
        f"train.max_steps={steps}", "train.checkpoint.every=0", "train.log_every=1"])
    t = cfg.train
    seq, vocab = cfg.tokenize.seq_len, cfg.tokenizer.vocab_size
    accum = t.global_batch_size // (t.micro_batch_size * t.launch.world_size)
    micro = t.micro_batch_size
    while micro > 1 and planned(t, vocab, seq, micro) > HEADROOM * props.total_memory:
        micro, accum = micro // 2, accum * 2
    launch_cfg = t.launch.model_copy(update={"nproc_per_node": 1, "nodes": 1, "node_rank": 0,
                                             "peak_tflops": override, "device": "cuda"})
    t = t.model_copy(update={"micro_batch_size": micro, "global_batch_size": micro * accum, "launch": launch_cfg})
    t = type(t).model_validate(t.model_dump())
    if micro != cfg.train.micro_batch_size:
        print(f"{name}: micro batch {cfg.train.micro_batch_size} does not fit {props.total_memory / GB:.0f} GiB by "
              f"the planner: micro {micro} x accumulation {accum}", flush=True)
    return cfg, t, seq, vocab, accum


def bare_loop(t, vocab: int, seq: int, accum: int) -> float:
    """Tokens/s of a bare loop: the trainer's model, micro batch, accumulation, dtype, compile, clipping."""
    model, _ = build_model(t, vocab, dev)
    model = model.to(dev)
    run = torch.compile(model) if t.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=t.optimizer.lr, betas=tuple(t.optimizer.betas), fused=True)
    ids = torch.randint(0, vocab, (accum, t.micro_batch_size, seq + 1), device=dev)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=t.precision == "bf16")
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a in range(accum):
            with amp:
                logits = run(input_ids=ids[a, :, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids[a, :, 1:].reshape(-1))
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del model, run, opt
    torch.cuda.empty_cache()
    return accum * t.micro_batch_size * seq / statistics.median(times[len(times) // 3:])


results: dict[str, tuple[float, float]] = {}
with tempfile.TemporaryDirectory() as tmp:
    for name in os.environ["PRESETS"].split():
        cfg, t, seq, vocab, accum = one_gpu(name)
        data = write_npy_fixture(Path(tmp) / f"data-{seq}-{vocab}", n=4096, seq_len=seq, vocab_size=vocab)
        root = Path(tmp) / name
        spec = {"train": t.model_dump(mode="json"), "data_dir": str(data), "seq_len": seq, "vocab_size": vocab,
                "checkpoint_dir": str(root / "ckpt"), "export_dir": str(root / "export"), "run_dir": str(root),
                "base_dir": "."}
        quiet = os.environ.get("VERBOSE", "0") != "1"
        res = launch(t.launch, spec, root, on_log=(lambda line: None) if quiet else print)
        tail = res.metrics[len(res.metrics) // 3:] or res.metrics
        tps = statistics.median(r["tokens_per_s"] for r in tail)
        mfu = statistics.median(r["mfu"] for r in tail) if peak else float("nan")
        mem = max(r["peak_mem_mb"] for r in res.metrics) * 2**20
        plan = planned(t, vocab, seq, t.micro_batch_size)
        attn = json.loads((root / "summary.json").read_text())["attention"]
        bare = bare_loop(t, vocab, seq, accum)
        print(f"{name}: {t.strategy} attention={attn} compile={t.compile} micro={t.micro_batch_size} seq={seq} "
              f"accum={accum} | trainer {tps:.0f} tok/s, MFU {mfu:.3f} | bare loop {bare:.0f} tok/s, trainer/bare "
              f"{tps / bare:.3f} | peak memory {mem / GB:.1f} GiB, planner {plan / GB:.1f} GiB "
              f"(measured/planned {mem / plan:.2f})", flush=True)
        results[name] = (mfu, tps / bare)
if "gpu-125m" in results:
    print(f"RESULT mfu_125m {results['gpu-125m'][0]:.3f} goal >= 0.40")
if "gpu-1b" in results:
    print(f"RESULT mfu_1b {results['gpu-1b'][0]:.3f} goal >= 0.50")
print(f"RESULT trainer_vs_bare {min(r[1] for r in results.values()):.3f} goal >= 0.95")
PYEOF
