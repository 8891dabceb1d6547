#!/usr/bin/env bash
# MFU of the GPU presets as they ship: configs/gpu-125m.yaml and configs/gpu-1b.yaml. Each preset's
# train: section runs unchanged (model, strategy, precision, attention, torch.compile, batch sizes)
# through the real launcher (torchrun, as the pretrain stage starts it); only train.max_steps and
# train.checkpoint.every come from here. MFU = the trainer's own per-step figure against the
# device's peak dense bf16 FLOP/s (llmpipe.training.model.PEAK_FLOPS), median after the compile
# warm-up. On a machine with fewer GPUs than the preset asks for, the run keeps the per-GPU work
# (micro batch, accumulation) on the GPUs there are and says so; FSDP2 on one GPU becomes DDP.
# Peer: the same model's forward + backward + fused AdamW in a bare torch loop on one GPU (same micro
# batch, seq, dtype, attention, compile).
# Goal: >= 50% MFU on an H100/H200-class GPU (published small-model figures: ~40%, OLMo-core 1B on H100).
# Usage: bash benchmarks/gpu/mfu.sh [STEPS]   (env: PRESETS="gpu-125m gpu-1b", PEER=0 skips the bare loop,
#        VERBOSE=1 prints the workers' log)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
# no CUDA GPU: one line and exit 2, before anything is built (the test suite checks this refusal on CPU)
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
  || { echo "benchmarks/gpu/mfu.sh needs a CUDA GPU (torch sees none): nothing measured" >&2; exit 2; }
STEPS="${1:-40}" PRESETS="${PRESETS:-gpu-125m gpu-1b}" PEER="${PEER:-1}" "$PY" - <<'PYEOF'
import json, os, statistics, tempfile, time
from pathlib import Path

import torch

from llmpipe.config import load_config
from llmpipe.training.data import write_npy_fixture
from llmpipe.training.launch import launch
from llmpipe.training.model import build_model, device_peak_flops, flops_per_token

assert torch.cuda.is_available(), "benchmarks/gpu/mfu.sh needs a CUDA GPU"
steps, gpus = int(os.environ["STEPS"]), torch.cuda.device_count()
dev = torch.device("cuda:0")
peak = device_peak_flops(dev)
print(f"device {gpus} x {torch.cuda.get_device_name(0)}, peak bf16 {peak and peak / 1e12} TFLOP/s, "
      f"torch {torch.__version__}")


def preset_train(name: str):
    """The preset's train: section, with only the run length and checkpoint cadence overridden."""
    cfg = load_config(Path("configs") / f"{name}.yaml", [f"train.max_steps={steps}", "train.checkpoint.every=0"])
    t = cfg.train
    update = {}
    if t.launch.world_size > gpus:  # keep each GPU's work: micro batch and accumulation
        accum = t.global_batch_size // (t.micro_batch_size * t.launch.world_size)
        update["global_batch_size"] = t.micro_batch_size * gpus * accum
        update["launch"] = t.launch.model_copy(update={"nproc_per_node": gpus, "nodes": 1, "node_rank": 0})
        if gpus == 1 and t.strategy == "fsdp2":
            update["strategy"] = "ddp"  # one process: nothing to shard over
        print(f"{name}: {t.launch.world_size} GPUs asked, {gpus} here: running {update['launch'].nproc_per_node} "
              f"process(es), global batch {update['global_batch_size']}, strategy {update.get('strategy', t.strategy)}")
    return cfg, t.model_copy(update=update)


def peer_loop(t, vocab: int, seq: int) -> tuple[float, float]:
    """(tokens/s, MFU) of a bare loop on one GPU: the same model, micro batch, dtype, attention, compile."""
    model, attn = build_model(t, vocab, dev)
    model = model.to(dev)
    run = torch.compile(model) if t.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=t.optimizer.lr, fused=True)
    ids = torch.randint(0, vocab, (t.micro_batch_size, seq), device=dev)
    times = []
    for _ in range(min(steps, 20)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = run(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab)[:-1], ids.reshape(-1)[1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    fpt = flops_per_token(model.config, seq)
    del model, run, opt
    torch.cuda.empty_cache()
    tps = t.micro_batch_size * seq / statistics.median(times[5:])
    return tps, (tps * fpt / peak if peak else float("nan"))


results = {}
with tempfile.TemporaryDirectory() as tmp:
    for name in os.environ["PRESETS"].split():
        cfg, t = preset_train(name)
        seq, vocab = cfg.tokenize.seq_len, cfg.tokenizer.vocab_size
        data = write_npy_fixture(Path(tmp) / f"data-{seq}-{vocab}", n=2048, seq_len=seq, vocab_size=vocab)
        root = Path(tmp) / name
        spec = {"train": t.model_dump(mode="json"), "data_dir": str(data), "seq_len": seq, "vocab_size": vocab,
                "checkpoint_dir": str(root / "ckpt"), "export_dir": str(root / "export"), "base_dir": "."}
        quiet = os.environ.get("VERBOSE", "0") != "1"  # VERBOSE=1: the workers' log lines (compile, steps)
        res = launch(t.launch, spec, root, on_log=(lambda line: None) if quiet else print)
        recs = res.metrics
        tail = recs[max(3, len(recs) // 3):] or recs
        mfu = statistics.median(r["mfu"] for r in tail)
        tps = statistics.median(r["tokens_per_s"] for r in tail) / t.launch.world_size  # per GPU
        mem = max(r["peak_mem_mb"] for r in recs)
        summary = json.loads((root / "summary.json").read_text())
        line = (f"{name}: strategy={t.strategy} attention={summary['attention']} compile={t.compile} "
                f"GPUs={t.launch.world_size} micro={t.micro_batch_size} seq={seq} accum="
                f"{t.global_batch_size // (t.micro_batch_size * t.launch.world_size)} | trainer {tps:.0f} tok/s/GPU "
                f"MFU {mfu:.3f} | peak mem {mem:.0f} MiB")
        if os.environ.get("PEER", "1") == "1":
            peer, peer_mfu = peer_loop(t, vocab, seq)
            line += f" | bare loop {peer:.0f} tok/s/GPU MFU {peer_mfu:.3f}, trainer/bare {tps / peer:.3f}"
        print(line, flush=True)
        results[name] = mfu
best = results.get("gpu-1b", max(results.values()))
print(f"RESULT mfu_1b_bf16 {best:.3f} goal >= 0.50")
PYEOF
