"""The ``pretrain`` stage: check the plan, launch the workers, publish the exported model.

The artifact is a ``save_pretrained`` folder (``config.json`` + ``model.safetensors``) with the
tokenizer files copied in, so ``AutoModelForCausalLM.from_pretrained(artifact)`` and
``AutoTokenizer.from_pretrained(artifact)`` both work, plus ``metrics.jsonl`` (step, loss, lr,
gradient norm, tokens: results only, so the same key gives the same bytes) and ``loss_curve.png``.
Speed and memory (tokens/s, FLOP/s, MFU, peak memory, step time) are measurements of one run: they
go to the manifest's stats, and the per-step records with them stay in the run folder.
Checkpoints live outside the artifact (``<store>/pretrain/_runs/<key>``) so a killed run resumes
from them on the next attempt with the same key.

With ``train.lr_find.enabled`` the stage first runs the LR finder in this process on the same model
and data (``lr_finder.find``: what ``llmpipe lr-find`` runs) and trains with its suggestion as the
peak learning rate; the sweep (``lr_find.json``) and its curve (``lr_find.png``) go into the artifact,
the learning rate and the rule into the stats. The sweep's result is kept in the run folder, so a
resumed run trains with the same rate without sweeping again.

Two runs of one key give the same bytes at the same threads per worker
(``train.launch.threads_per_process``, a run setting: 0 = cores / processes; the stats record it):
CPU kernels split their float reductions by thread count, so on 2 gloo processes 2 threads each
instead of 1 change the loss from step 2 on in the 7th digit, and the weights with it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from llmpipe.files import link_file
from llmpipe.stage import StageContext, stage
from llmpipe.store import MANIFEST
from llmpipe.tokenization.layout import TOKENIZER
from llmpipe.training.config import TrainConfig
from llmpipe.training.launch import TrainingError, launch
from llmpipe.training.layout import PRETRAIN
from llmpipe.training.strategy import resolve as resolve_strategy
from llmpipe.training.trainer import MEASURED_FIELDS

SKIP_TOKENIZER_FILES = {MANIFEST}  # the tokenizer artifact's manifest is no tokenizer file


def vocab_size_of(tokenizer_dir: Path) -> int:
    """The vocabulary size of the tokenizer artifact (``tokenizer.json``, else ``meta.json``)."""
    tj = tokenizer_dir / TOKENIZER.tokenizer
    if tj.exists():
        from tokenizers import Tokenizer

        return int(Tokenizer.from_file(str(tj)).get_vocab_size())
    for name in ("meta.json", "tokenizer_meta.json"):
        meta = tokenizer_dir / name
        if meta.exists() and "vocab_size" in json.loads(meta.read_text()):
            return int(json.loads(meta.read_text())["vocab_size"])
    raise TrainingError(f"train: tokenizer artifact {tokenizer_dir} has no tokenizer.json to read the vocab size")


def model_config_of(cfg: TrainConfig, vocab_size: int) -> Any:
    """The model's ``LlamaConfig`` without building the model: the checkpoint's, or the preset's."""
    if cfg.model.init_from:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(cfg.model.init_from)
    from llmpipe.training.model import llama_config

    return llama_config(cfg.model.preset, vocab_size, cfg.model.overrides)


def resolve_deepspeed(cfg: TrainConfig, base_dir: Path) -> TrainConfig:
    """A relative ``train.deepspeed`` path is read against the config file's folder, then the cwd."""
    if isinstance(cfg.deepspeed, str) and not Path(cfg.deepspeed).is_absolute():
        for root in (base_dir, Path.cwd()):
            if (root / cfg.deepspeed).is_file():
                return cfg.model_copy(update={"deepspeed": str((root / cfg.deepspeed).resolve())})
    return cfg


def plan(cfg: TrainConfig, data_dir: Path, vocab_size: int) -> dict[str, Any]:
    """Everything that can be checked before a worker starts; errors name the ``train.*`` key."""
    from llmpipe.training.data import open_packed
    from llmpipe.training.model import max_positions  # torch: loaded when the stage runs, not registers

    world = cfg.data_parallel  # the ranks of one tensor-parallel group share their micro-batches
    if cfg.global_batch_size % (cfg.micro_batch_size * world):
        per = " / parallel.tensor" if cfg.parallel.tensor > 1 else ""
        raise TrainingError(
            f"train.global_batch_size: must be divisible by micro_batch_size x world size{per} "
            f"({cfg.micro_batch_size} x {world} = {cfg.micro_batch_size * world}), got {cfg.global_batch_size}")
    if cfg.strategy == "deepspeed":  # before any worker starts: a ZeRO setting that cannot skip a step
        from llmpipe.training.engines import deepspeed_config

        try:
            deepspeed_config(cfg, cfg.launch.world_size)
        except ValueError as e:  # json.JSONDecodeError too
            raise TrainingError(str(e) if str(e).startswith("train.") else f"train.deepspeed: {e}") from None
        except OSError as e:
            raise TrainingError(f"train.deepspeed: cannot read {cfg.deepspeed}: {e.strerror}") from None
    try:
        source = open_packed(data_dir, cfg.split)
    except FileNotFoundError as e:
        raise TrainingError(f"train.split: missing shards: {e}") from None
    if len(source) == 0:
        raise TrainingError(f"train.split: the packed split {cfg.split!r} under {data_dir} is empty")
    if cfg.eval_every:
        try:
            held_out = open_packed(data_dir, cfg.eval_split)
        except (FileNotFoundError, ValueError) as e:
            raise TrainingError(f"train.eval_split: no packed split {cfg.eval_split!r} to validate on: {e}") from None
        if len(held_out) == 0:
            raise TrainingError(f"train.eval_split: the packed split {cfg.eval_split!r} under {data_dir} is empty")
    if cfg.loss.entity_weight is not None and not getattr(source, "index", {}).get("entity_mask"):
        raise TrainingError("train.loss.entity_weight: the tokenize artifact has no entity mask; set "
                            "tokenize.entity_mask: true (and entities.enabled: true)")
    seq_len = cfg.seq_len or int(source.seq_len)
    if seq_len > source.seq_len:
        raise TrainingError(f"train.seq_len: {seq_len} is longer than the packed sequences ({source.seq_len})")
    if not cfg.model.init_from:
        limit = max_positions(cfg.model.preset, cfg.model.overrides)
        if seq_len > limit:
            raise TrainingError(f"train.seq_len: {seq_len} exceeds the model's max_position_embeddings ({limit})")
    if cfg.precision == "fp16" and not _will_use_cuda(cfg):
        raise TrainingError("train.precision: fp16 with loss scaling needs a GPU; use bf16 or fp32 on CPU")
    if cfg.strategy == "deepspeed" and isinstance(cfg.deepspeed, str) and not Path(cfg.deepspeed).is_file():
        raise TrainingError(f"train.deepspeed: no such DeepSpeed config file: {cfg.deepspeed}")
    if _will_use_cuda(cfg):
        import torch

        if cfg.launch.nproc_per_node > torch.cuda.device_count():
            raise TrainingError(f"train.launch.nproc_per_node: {cfg.launch.nproc_per_node} processes but only "
                                f"{torch.cuda.device_count()} GPUs on this node")
    if cfg.model_parallel > 1:
        from llmpipe.training.parallel import check_divides
        from llmpipe.training.pipeline import check_layers

        try:
            check_divides(model_config_of(cfg, vocab_size), cfg.parallel.tensor)
            check_layers(model_config_of(cfg, vocab_size), cfg.parallel.pipeline)
        except ValueError as e:  # json.JSONDecodeError too
            raise TrainingError(str(e) if str(e).startswith("train.") else f"train.deepspeed: {e}") from None
        except OSError as e:
            raise TrainingError(f"train.deepspeed: cannot read {cfg.deepspeed}: {e.strerror}") from None
    return {"seq_len": seq_len, "sequences": len(source), "world_size": cfg.launch.world_size,
            "accumulation": cfg.global_batch_size // (cfg.micro_batch_size * world), "vocab_size": vocab_size,
            **({"tensor_parallel": cfg.parallel.tensor} if cfg.parallel.tensor > 1 else {}),
            **({"pipeline_parallel": cfg.parallel.pipeline} if cfg.parallel.pipeline > 1 else {})}


def _will_use_cuda(cfg: TrainConfig) -> bool:
    if cfg.launch.device != "auto":
        return cfg.launch.device == "cuda"
    import torch

    return torch.cuda.is_available()


def run_dir_for(ctx: StageContext) -> Path:
    if ctx.config.checkpoint.dir:
        return Path(ctx.config.checkpoint.dir)
    return Path(ctx.store.shard_cache_root("pretrain")).parent / "_runs" / ctx.key[:32]


def plot_loss(metrics: list[dict[str, Any]], png: Path) -> None:
    """The loss curve (matplotlib Agg, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics if m.get("loss") is not None]
    losses = [m["loss"] for m in metrics if m.get("loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses, marker="." if len(steps) < 50 else None, label="training")
    val = [(m["step"], m["val_loss"]) for m in metrics if m.get("val_loss") is not None]
    if val:  # train.eval_every: the held-out slice's loss
        ax.plot(*zip(*val, strict=True), marker="o", label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, metadata={"Software": None})  # no library version in the bytes: only the curve
    plt.close(fig)


# version 3: train: in sub-sections (optimizer, schedule, guards, checkpoint, launch), so the key's
# config is nested; the same values train the same model
# version 4: train.lr_find in the key (its sweep and curve in the artifact when on); fp16 step records
# carry the loss scale
# version 5: the export carries the tokenizer's bos / eos / pad ids and use_cache: true, its tokenizer the
# model's positions as model_max_length; the tiny preset takes head size 32 and an MLP of 192
@stage("pretrain", version="5", inputs=("tokenize", "tokenizer"), config_field="train", flow="pretrain",
       extra="train", model=True, requires=lambda cfg: ("torch", "transformers", "tokenizers", "matplotlib", *(
           ("deepspeed",) if "deepspeed" in (cfg.train.strategy, cfg.train.launch.launcher) else ())))
def run_pretrain(ctx: StageContext) -> dict[str, Any]:
    """Pretrain a Llama-style model with torchrun/DeepSpeed workers and export it with its tokenizer."""
    cfg: TrainConfig = resolve_deepspeed(ctx.config, ctx.pipeline.base_dir())
    data_dir, tok_dir = Path(ctx.inputs["tokenize"]), Path(ctx.inputs["tokenizer"])
    vocab = vocab_size_of(tok_dir)
    p = plan(cfg, data_dir, vocab)
    cfg, chosen = resolve_strategy(cfg, model_config_of(cfg, vocab), p["seq_len"], ctx.log)
    p.update(chosen)
    run_dir = run_dir_for(ctx)
    found: dict[str, Any] = {}
    if cfg.lr_find.enabled:
        cfg, found = choose_lr(ctx, data_dir, p["seq_len"], vocab, run_dir, cfg)
    spec = {"train": cfg.model_dump(mode="json"), "data_dir": str(data_dir), "seq_len": p["seq_len"],
            "vocab_size": vocab, "checkpoint_dir": str(run_dir / "checkpoints"),
            "export_dir": str(run_dir / "export"), "base_dir": str(ctx.pipeline.base_dir()),
            "tokenizer_dir": str(tok_dir)}
    if cfg.eval_every:
        spec["token_bytes"] = str(write_token_bytes(tok_dir, vocab, run_dir))
    ctx.log.info("pretrain: %s on %d x %d processes, %d sequences of %d tokens, accumulation %d",
                 cfg.strategy, cfg.launch.nodes, cfg.launch.nproc_per_node, p["sequences"], p["seq_len"],
                 p["accumulation"])
    res = launch(cfg.launch, spec, run_dir, on_log=ctx.log.info, rdzv_id=ctx.key[:16],
                 on_metric=lambda r: ctx.progress("pretrain steps", int(r["step"]), cfg.max_steps))
    export, ckpt = run_dir / "export", ctx.out / PRETRAIN.checkpoint
    for f in sorted(export.iterdir()):
        link_file(f, ckpt / f.name)
    for f in sorted(tok_dir.iterdir()):
        if f.is_file() and f.name not in SKIP_TOKENIZER_FILES and not (ckpt / f.name).exists():
            shutil.copy2(f, ckpt / f.name)
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    (ctx.out / PRETRAIN.metrics).write_text("".join(json.dumps(results_only(m)) + "\n" for m in metrics))
    plot_loss(metrics, ctx.out / PRETRAIN.loss_curve)
    ctx.report_image("pretrain-loss", "Pretraining loss", ctx.out / PRETRAIN.loss_curve)
    last = metrics[-1]
    steady = metrics[len(metrics) // 2:] or metrics
    evals = [m for m in metrics if "val_loss" in m]
    stats = {**p, **found, **res.summary, "final_loss": last["loss"], "first_loss": metrics[0]["loss"],
             **({k: evals[-1][k] for k in ("val_loss", "val_bpb") if k in evals[-1]} if evals else {}),
             "tokens": last["tokens"], "seconds": round(res.seconds, 2),
             "tokens_per_s": sum(m["tokens_per_s"] for m in steady) / len(steady),
             "flops_per_s": sum(m["flops_per_s"] for m in steady) / len(steady),
             "step_time_s": sum(m["step_time_s"] for m in steady) / len(steady),
             "mfu": _mean_of(steady, "mfu"), "peak_mem_mb": max(m["peak_mem_mb"] for m in metrics)}
    ctx.report_stats("pretrain-summary", "Pretraining summary", list(stats))
    return stats


def write_token_bytes(tok_dir: Path, vocab: int, run_dir: Path) -> Path:
    """The UTF-8 bytes each token id spells (0: special tokens, ids past the tokenizer's), for the
    trainer's validation bits per byte: the evaluate stage's own table."""
    import numpy as np
    from transformers import AutoTokenizer

    from llmpipe.evaluation.metrics import token_byte_lengths

    lengths = token_byte_lengths(AutoTokenizer.from_pretrained(tok_dir))[:vocab]
    out = run_dir / "token_bytes.npy"
    run_dir.mkdir(parents=True, exist_ok=True)
    np.save(out, np.pad(lengths, (0, vocab - len(lengths))))
    return out


def _mean_of(records: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the records that have it (MFU: None where the device's peak is unknown)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def choose_lr(ctx: StageContext, data_dir: Path, seq_len: int, vocab: int, run_dir: Path,
              cfg: TrainConfig) -> tuple[TrainConfig, dict[str, Any]]:
    """``train.lr_find``: sweep on the stage's config as ``llmpipe lr-find`` does (``ctx.config``, before
    the strategy is resolved), write the sweep and its curve into the artifact, and return ``cfg`` with
    the suggestion as ``optimizer.lr`` plus the stats naming it. The sweep of this key is kept in the
    run folder: a resumed run reuses it."""
    from llmpipe.training.lr_finder import Sweep, find, plot

    saved = run_dir / PRETRAIN.lr_find
    kept = json.loads(saved.read_text()) if saved.is_file() else {}
    if kept.get("key") == ctx.key:
        result = Sweep(**kept["sweep"])
        ctx.log.info("lr_find: the sweep of this key ran already: learning rate %.3g", result.suggested_lr)
    else:
        ctx.log.info("lr_find: sweeping the learning rate from %g to %g over up to %d steps",
                     cfg.lr_find.min_lr, cfg.lr_find.max_lr, cfg.lr_find.steps)
        run_dir.mkdir(parents=True, exist_ok=True)
        result = find(resolve_deepspeed(ctx.config, ctx.pipeline.base_dir()), data_dir, seq_len, vocab, run_dir)
        saved.write_text(json.dumps({"key": ctx.key, "sweep": json.loads(result.to_json())}))
    (ctx.out / PRETRAIN.lr_find).write_text(result.to_json())
    plot(result, ctx.out / PRETRAIN.lr_find_curve)
    ctx.report_image("pretrain-lr-find", "LR finder: loss against learning rate", ctx.out / PRETRAIN.lr_find_curve)
    ctx.log.info("lr_find: training with learning rate %.3g (%s)", result.suggested_lr, result.rule)
    optimizer = cfg.optimizer.model_copy(update={"lr": result.suggested_lr})
    stats = {"lr": result.suggested_lr, "lr_find_rule": result.rule, "lr_find_steps": len(result.lrs)}
    return cfg.model_copy(update={"optimizer": optimizer}), stats


def results_only(record: dict[str, Any]) -> dict[str, Any]:
    """A step record without its measurements (they differ between two runs of the same key)."""
    return {k: v for k, v in record.items() if k not in MEASURED_FIELDS}
