#!/usr/bin/env bash
# MFU of the 125m and 1b presets on one GPU (bf16, flash-attn when installed else sdpa), our trainer
# in one process, against the device's peak dense bf16 FLOP/s (llmpipe.training.model.PEAK_FLOPS).
# Peer: the same model's forward+backward+AdamW in a bare torch loop (same batch, seq, dtype).
# Goal: >= 45% MFU on an H100/H200-class GPU.
# Usage: bash benchmarks/gpu/mfu.sh [STEPS]   (env: PRESETS="125m 1b", SEQ=2048, COMPILE=0|1)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
STEPS="${1:-30}" SEQ="${SEQ:-2048}" PRESETS="${PRESETS:-125m 1b}" COMPILE="${COMPILE:-0}" \
"$PY" - <<'PYEOF'
import json, os, statistics, tempfile, time
from pathlib import Path
import torch
from llmpipe.training.config import TrainConfig
from llmpipe.training.data import write_npy_fixture
from llmpipe.training.model import build_model, device_peak_flops, flops_per_token
from llmpipe.training.trainer import Trainer

assert torch.cuda.is_available(), "needs a GPU"
steps, seq = int(os.environ["STEPS"]), int(os.environ["SEQ"])
compile_ = os.environ.get("COMPILE") == "1"
dev = torch.device("cuda:0")
peak = device_peak_flops(dev)
print(f"device {torch.cuda.get_device_name(0)}, peak bf16 {peak and peak / 1e12} TFLOP/s, torch {torch.__version__}")
VOCAB = 32000
MICRO = {"125m": 16, "1b": 8}
results = {}
with tempfile.TemporaryDirectory() as tmp:
    data = write_npy_fixture(Path(tmp) / "data", n=512, seq_len=seq, vocab_size=VOCAB)
    for preset in os.environ["PRESETS"].split():
        mb = MICRO.get(preset, 8)
        cfg = TrainConfig(model={"preset": preset}, precision="bf16", max_steps=steps, compile=compile_,
                          global_batch_size=mb, micro_batch_size=mb, optimizer={"lr": 3e-4},
                          schedule={"warmup_steps": 2}, checkpoint={"every": 0},
                          launch={"device": "cuda", "nproc_per_node": 1})
        root = Path(tmp) / preset
        spec = {"train": cfg.model_dump(mode="json"), "data_dir": str(data), "seq_len": seq,
                "vocab_size": VOCAB, "checkpoint_dir": str(root / "ckpt"), "export_dir": str(root / "export"),
                "run_dir": str(root)}
        tr = Trainer(spec)
        tr.export = lambda: None  # measuring speed only
        tr.save_checkpoint = lambda: None
        tr.run()
        recs = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
        tail = recs[len(recs) // 3:]
        mfu = statistics.median(r["mfu"] for r in tail)
        tps = statistics.median(r["tokens_per_s"] for r in tail)
        # peer: bare loop, same model / batch / dtype
        model, attn = build_model(cfg, VOCAB, dev)
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        ids = torch.randint(0, VOCAB, (mb, seq), device=dev)
        times = []
        for i in range(min(steps, 15)):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
        peer_tps = mb * seq / statistics.median(times[3:])
        fpt = flops_per_token(model.config, seq)
        peer_mfu = peer_tps * fpt / peak if peak else float("nan")
        mem = max(r["peak_mem_mb"] for r in recs)
        print(f"{preset}: attention={attn} micro={mb} seq={seq} trainer {tps:.0f} tok/s MFU {mfu:.3f} | "
              f"bare loop {peer_tps:.0f} tok/s MFU {peer_mfu:.3f} | ratio {tps / peer_tps:.3f} | peak mem {mem:.0f} MiB")
        results[preset] = mfu
        del tr, model, opt
        torch.cuda.empty_cache()
best = results.get("1b", max(results.values()))
print(f"RESULT mfu_1b_bf16 {best:.3f} goal >= 0.45")
PYEOF
