"""The ``evaluate`` stage: the pretrained model on the held-out split, beside the previous evaluation.

Writes ``results.json`` (metrics, the data and settings they were computed with, the model's size)
and a markdown regression table. The quantize stage reads ``results.json`` as the baseline of its
quality gate and re-runs :func:`evaluate_model` with the settings recorded here, so the fp and the
quantized numbers always come from the same data and the same code.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmpipe.evaluation.config import EvaluateConfig
from llmpipe.evaluation.report import metric_rows, regression_markdown
from llmpipe.stage import StageContext, stage

if TYPE_CHECKING:  # torch and the model code load when the stage runs, not when it registers
    import torch

VERSION = "1"
RESULTS = "results.json"


def run_suite(ckpt: Path, tokenize_dir: Path, cfg: EvaluateConfig, device: torch.device,
              model: Any = None) -> dict[str, Any]:
    """Every metric of the checkpoint at ``ckpt`` (or of an already loaded ``model`` with its tokenizer)."""
    from llmpipe.evaluation.data import load_sequences
    from llmpipe.evaluation.metrics import evaluate_model, load_task, token_byte_lengths
    from llmpipe.evaluation.model_io import checkpoint_bytes, load_model, load_tokenizer

    tok = load_tokenizer(ckpt)
    model = model if model is not None else load_model(ckpt, device)
    seqs, names, meta = load_sequences(tokenize_dir, cfg.split, cfg.max_sequences)
    tasks = {t.name: load_task(t.resolved(), t.limit) for t in cfg.tasks}
    byte_len = token_byte_lengths(tok)
    metrics = evaluate_model(model, tok, seqs, batch_size=cfg.batch_size, prompts=cfg.prompts,
                             max_new_tokens=cfg.max_new_tokens, tasks=tasks, byte_len=byte_len,
                             language_names=names)
    first = int(byte_len[int(seqs[0].tokens[0])])  # the split's first token is never a target
    return {"metrics": metrics, "data": meta, "bytes_check": bytes_check(metrics, meta, first),
            "model": {"checkpoint_bytes": checkpoint_bytes(ckpt),
                      "parameters": sum(p.numel() for p in model.parameters()), "device": str(device)}}


def bytes_check(metrics: dict[str, Any], meta: dict[str, Any], first_token_bytes: int) -> dict[str, Any] | None:
    """When the whole split was scored: bytes counted from token ids vs the bytes the tokenize stage
    recorded from the texts. Targets cover every token but the split's first one (packed items
    overlap by one token), so that token's bytes are added back. They agree for a byte-level
    tokenizer; a gap means bits-per-byte is approximate."""
    per = meta.get("per_language")
    if not per or meta.get("sequences_used") != meta.get("sequences_total"):
        return None
    want = sum(int(v.get("bytes", 0)) for v in per.values())
    got = int(metrics["overall"]["bytes"]) + first_token_bytes
    return {"bytes_from_tokens": got, "bytes_from_texts": want, "match": got == want}


def previous_results(ctx: StageContext) -> tuple[dict[str, Any] | None, str | None, dict[str, Any] | None]:
    """(results, key, manifest) of the latest other evaluate artifact in the store, if any."""
    latest = getattr(ctx.store, "latest", None)
    art = latest("evaluate", exclude_key=ctx.key) if latest is not None else None
    if art is None or not (Path(art.path) / RESULTS).is_file():
        return None, None, None
    return json.loads((Path(art.path) / RESULTS).read_text()), art.key, art.manifest


def summary(metrics: dict[str, Any]) -> dict[str, Any]:
    o = metrics["overall"]
    out = {k: o[k] for k in ("perplexity", "bits_per_byte", "accuracy", "tokens", "bytes")}
    out["generation_tokens_per_s"] = metrics.get("generation_tokens_per_s")
    for name, t in metrics.get("tasks", {}).items():
        out[f"task_{name}_acc"] = t["acc"]
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


@stage("evaluate", version=VERSION, inputs=("pretrain", "tokenize"), config_field="evaluate", flow="pretrain")
def run_evaluate(ctx: StageContext) -> dict[str, Any]:
    """Perplexity, bits per byte and accuracy on held-out data; greedy samples; regression table."""
    from llmpipe.evaluation.model_io import find_checkpoint, resolve_device

    cfg: EvaluateConfig = ctx.config
    device = resolve_device(cfg.device)
    ckpt = find_checkpoint(ctx.inputs["pretrain"])
    t0 = time.perf_counter()
    res = run_suite(ckpt, ctx.inputs["tokenize"], cfg, device)
    res.update({"settings": cfg.key_dict(), "inputs": dict(ctx.input_keys),
                "seconds": round(time.perf_counter() - t0, 3)})
    (ctx.out / RESULTS).write_text(json.dumps(res, indent=1, sort_keys=True, default=str))
    if res["bytes_check"] and not res["bytes_check"]["match"]:
        ctx.log.warning("evaluate: token bytes %s != text bytes %s; bits per byte is approximate",
                        res["bytes_check"]["bytes_from_tokens"], res["bytes_check"]["bytes_from_texts"])

    prev, prev_key, prev_mf = previous_results(ctx)
    same_data = prev is not None and prev.get("inputs", {}).get("tokenize") == ctx.input_keys.get("tokenize")
    ctx.report_markdown("evaluation", "Evaluation vs previous model",
                        regression_markdown(res["metrics"], prev and prev["metrics"], prev_key, same_data))
    ctx.report_table("evaluation-metrics", "Evaluation metrics",
                     [{k: v for k, v in r.items()} for r in metric_rows(res["metrics"], prev and prev["metrics"])])
    o = res["metrics"]["overall"]
    ctx.log.info("evaluate: ppl %.4g, bpb %.4g, acc %.4g on %d tokens (%s)", o["perplexity"],
                 o["bits_per_byte"], o["accuracy"], o["tokens"], device)
    stats = summary(res["metrics"])
    stats.update({"previous_key": prev_key, "device": str(device), "seconds": res["seconds"]})
    if prev is not None:
        p = prev["metrics"]["overall"]
        stats["perplexity_change"] = o["perplexity"] - p["perplexity"]
        stats["bits_per_byte_change"] = o["bits_per_byte"] - p["bits_per_byte"]
    return stats
