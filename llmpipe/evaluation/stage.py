"""The ``evaluate`` stage: the pretrained model on the held-out split, beside the previous evaluation.

Writes ``results.json`` (metrics, the data and settings they were computed with, the model's size,
and under ``baseline`` a unigram model of the train split scored on the same bytes, with the ratio of
the two bits per byte, under ``kn_baseline`` an interpolated Kneser-Ney model of the same text: see
:mod:`llmpipe.evaluation.baseline`; ``metrics["documents"]``: bits per byte over whole held-out
documents in rolling windows, :mod:`llmpipe.evaluation.documents`) and a markdown regression table. How long it took (scoring, generation tokens/s) goes to the
manifest's stats only, so the same key always gives the same ``results.json``. The quantize stage reads ``results.json`` as the baseline of its
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
from llmpipe.evaluation.layout import EVALUATE
from llmpipe.evaluation.report import metric_rows, regression_markdown
from llmpipe.stage import MODEL, StageContext, stage

if TYPE_CHECKING:  # torch and the model code load when the stage runs, not when it registers
    import torch

# 3: results.json gains "baseline" (the unigram model); 4: the previous-model report moves to stats;
# 5: with an entity mask in the tokenize artifact, metrics (and the baseline's) gain "entities";
# 6: metrics gain "harness" (lm-evaluation-harness tasks, their standard errors and config), and
# evaluate.tasks' multiple-choice files are scored there (metrics["tasks"] is gone); 7: metrics gain
# "documents" (whole held-out documents in rolling windows) and results.json "kn_baseline"
VERSION = "7"


RESULTS = EVALUATE.results


def run_suite(ckpt: Path, tokenize_dir: Path, cfg: EvaluateConfig, device: torch.device,
              model: Any = None, baseline: bool = False) -> dict[str, Any]:
    """Every metric of the checkpoint at ``ckpt`` (or of an already loaded ``model`` with its tokenizer);
    with ``baseline``, also the unigram model of the train split on the same sequences (``res["baseline"]``)."""
    from llmpipe.evaluation.data import load_sequences
    from llmpipe.evaluation.metrics import evaluate_model, token_byte_lengths
    from llmpipe.evaluation.model_io import checkpoint_bytes, load_model, load_tokenizer

    tok = load_tokenizer(ckpt)
    model = model if model is not None else load_model(ckpt, device)
    seqs, names, meta = load_sequences(tokenize_dir, cfg.split, cfg.max_sequences)
    byte_len = token_byte_lengths(tok)
    metrics = evaluate_model(model, tok, seqs, batch_size=cfg.batch_size, prompts=cfg.prompts,
                             max_new_tokens=cfg.max_new_tokens, byte_len=byte_len,
                             language_names=names)
    docs: list[Any] = []
    if cfg.documents:  # document-level: whole held-out documents in rolling windows
        from llmpipe.evaluation.documents import document_metrics, held_out_documents, model_window

        t0 = time.perf_counter()
        docs, n_docs = held_out_documents(tokenize_dir, cfg.split, cfg.documents)
        metrics["documents"] = document_metrics(
            model, docs, byte_len, cfg.doc_window or model_window(model, tok), int(tok.eos_token_id),
            tok.bos_token_id, cfg.doc_stride, cfg.batch_size)
        metrics["documents"]["documents_total"] = n_docs
        metrics.setdefault("timings", {})["documents_seconds"] = round(time.perf_counter() - t0, 3)
    if cfg.harness.tasks or cfg.tasks:  # last: harness.dtype may cast the model in place
        from llmpipe.evaluation.harness import run_harness

        t0 = time.perf_counter()
        metrics["harness"] = run_harness(model, tok, cfg.harness, cfg.tasks)
        metrics.setdefault("timings", {})["harness_seconds"] = round(time.perf_counter() - t0, 3)
    first = int(byte_len[int(seqs[0].tokens[0])])  # the split's first token is never a target
    res = {"metrics": metrics, "data": meta, "bytes_check": bytes_check(metrics, meta, first),
           "model": {"checkpoint_bytes": checkpoint_bytes(ckpt),
                     "parameters": sum(p.numel() for p in model.parameters()), "device": str(device)}}
    if baseline:
        res["baseline"] = unigram_baseline(tokenize_dir, seqs, names, tok.pad_token_id, byte_len, metrics)
        res["kn_baseline"] = kn_baseline(tokenize_dir, cfg, seqs, names, docs, tok, byte_len, metrics)
    return res


def kn_baseline(tokenize_dir: Path, cfg: EvaluateConfig, seqs: list[Any], names: list[str], docs: list[Any],
                tok: Any, byte_len: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """The interpolated Kneser-Ney model of the train split on the unigram's targets (packed windows)
    and on the same whole documents as the model, with the model's bpb over it on each."""
    import numpy as np

    from llmpipe.evaluation.baseline import KneserNey, bpb_ratio, kn_metrics, train_documents
    from llmpipe.evaluation.metrics import LN2

    train = train_documents(tokenize_dir, "train", cfg.kn_max_train_tokens)
    eos, bos = int(tok.eos_token_id), tok.bos_token_id
    kn = KneserNey(train, cfg.kn_order, len(byte_len), eos, bos)
    res = {"kind": "kneser-ney", "split": "train", "train_tokens": int(sum(len(d) for d in train)),
           **kn_metrics(seqs, kn, tok.pad_token_id, byte_len, names)}
    res["bits_per_byte_ratio"] = bpb_ratio(metrics["overall"]["bits_per_byte"], res["overall"]["bits_per_byte"])
    if "documents" in metrics:
        nll = nbytes = 0.0
        for d in docs:
            ids = d if bos is not None and len(d) and d[0] == bos else np.concatenate([[eos], d])
            nll += float(kn.target_nll(ids).sum())
            nbytes += int(byte_len[ids[1:]].sum())
        bpb = nll / (LN2 * nbytes) if nbytes else float("nan")
        res["documents"] = {"bits_per_byte": bpb, "bytes": int(nbytes),
                            "bits_per_byte_ratio": bpb_ratio(metrics["documents"]["bits_per_byte"], bpb)}
    return res


def unigram_baseline(tokenize_dir: Path, seqs: list[Any], names: list[str], pad_id: int | None,
                     byte_len: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """The unigram model of the train split on the model's held-out sequences, and the bpb ratios."""
    from llmpipe.evaluation.baseline import bpb_ratio, train_token_counts, unigram_metrics

    uni = unigram_metrics(seqs, train_token_counts(tokenize_dir, "train"), pad_id, byte_len, names)
    uni = {"kind": "unigram", "split": "train", **uni}
    uni["bits_per_byte_ratio"] = bpb_ratio(metrics["overall"]["bits_per_byte"], uni["overall"]["bits_per_byte"])
    uni["per_language_bits_per_byte_ratio"] = {
        lang: bpb_ratio(m["bits_per_byte"], uni["per_language"][lang]["bits_per_byte"])
        for lang, m in metrics["per_language"].items() if lang in uni["per_language"]}
    return uni


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


def harness_modules(cfg: EvaluateConfig) -> tuple[str, ...]:
    """What ``evaluate.harness`` imports beyond the [train] extra (the [eval] extra): none when it is off."""
    return ("lm_eval",) if cfg.harness.tasks or cfg.tasks else ()


def previous_results(ctx: StageContext) -> tuple[dict[str, Any] | None, str | None, dict[str, Any] | None]:
    """(results, key, manifest) of the latest other evaluate artifact in the store, if any."""
    latest = getattr(ctx.store, "latest", None)
    art = latest("evaluate", exclude_key=ctx.key) if latest is not None else None
    if art is None or not (Path(art.path) / RESULTS).is_file():
        return None, None, None
    return json.loads((Path(art.path) / RESULTS).read_text()), art.key, art.manifest


def _finite(v: Any) -> Any:
    """NaN as None: manifest stats are strict JSON."""
    return None if isinstance(v, float) and math.isnan(v) else v


def summary(metrics: dict[str, Any]) -> dict[str, Any]:
    o = metrics["overall"]
    out = {k: o[k] for k in ("perplexity", "bits_per_byte", "accuracy", "tokens", "bytes")}
    for name, t in (metrics.get("harness") or {}).get("tasks", {}).items():
        for m, v in t["metrics"].items():
            out[f"{name}/{m}"] = v
            out[f"{name}/{m}_stderr"] = t["stderr"].get(m)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def tuned_results(ctx: StageContext, ckpt: Path, device: torch.device) -> tuple[dict[str, Any] | None, Any]:
    """(what a tuned model adds to results.json, the loaded model) when the model is sft's or
    preference's: chat samples through its template and, after DPO, held-out preference accuracy and
    reward margin (``llmpipe.posttrain.stage.tuned_measures``); (None, None) for pretrain's model."""
    if ctx.model_from in (None, "pretrain"):
        return None, None
    from llmpipe.evaluation.model_io import load_model, load_tokenizer
    from llmpipe.posttrain.stage import tuned_measures

    model = load_model(ckpt, device)
    t0 = time.perf_counter()
    tuned = tuned_measures(ctx.pipeline, ctx.model_from, Path(ctx.inputs["model"]), model, load_tokenizer(ckpt))
    ctx.log.info("evaluate: the %s model: %s in %.1fs", ctx.model_from,
                 {k: v for k, v in tuned.items() if k != "chat_samples"}, time.perf_counter() - t0)
    return tuned, model


def tuned_stats(ctx: StageContext, tuned: dict[str, Any]) -> dict[str, Any]:
    """The tuned model's figures in the stats, with a table of them and one of its chat samples."""
    figures = {k: v for k, v in tuned.items() if k != "chat_samples"}
    ctx.report_stats("evaluation-tuned", f"The tuned model ({tuned['model_from']}): held-out preference pairs",
                     list(figures))
    ctx.report_table("evaluation-chat-samples", "Chat samples through the chat template (held-out prompts, greedy)",
                     tuned["chat_samples"])
    return {**figures, "chat_samples": tuned["chat_samples"]}


# inputs: MODEL is the last active model stage (pretrain, or the tuned sft / preference model), and the
# key names it; with post-training on, the post_train flow ends here
@stage("evaluate", version=VERSION, inputs=(MODEL, "tokenize"), config_field="evaluate", flow="pretrain",
       also_flows=("post_train",), extra="train",
       requires=lambda cfg: ("torch", "transformers", *harness_modules(cfg.evaluate)))
def run_evaluate(ctx: StageContext) -> dict[str, Any]:
    """Perplexity, bits per byte and accuracy on held-out data (packed windows and whole documents)
    beside unigram and Kneser-Ney baselines; greedy samples; regression table."""
    from llmpipe.evaluation.model_io import find_checkpoint, resolve_device

    cfg: EvaluateConfig = ctx.config
    device = resolve_device(cfg.device)
    ckpt = find_checkpoint(ctx.inputs[MODEL])
    t0 = time.perf_counter()
    tuned, model = tuned_results(ctx, ckpt, device)
    res = run_suite(ckpt, ctx.inputs["tokenize"], cfg, device, model=model, baseline=True)
    timings = {**res["metrics"].pop("timings", {}), "seconds": round(time.perf_counter() - t0, 3)}
    res.update({"settings": cfg.key_dict(), "inputs": dict(ctx.input_keys)})
    if tuned is not None:
        res["tuned"] = tuned
    (ctx.out / RESULTS).write_text(json.dumps(res, indent=1, sort_keys=True, default=str))
    if res["bytes_check"] and not res["bytes_check"]["match"]:
        ctx.log.warning("evaluate: token bytes %s != text bytes %s; bits per byte is approximate",
                        res["bytes_check"]["bytes_from_tokens"], res["bytes_check"]["bytes_from_texts"])

    prev, prev_key, prev_mf = previous_results(ctx)
    same_data = prev is not None and prev.get("inputs", {}).get("tokenize") == ctx.input_keys.get("tokenize")
    base, prev_base = res["baseline"], prev and prev.get("baseline")  # an older results.json may have none
    # the previous model is whatever this store evaluated last: that comparison is no part of this
    # key's content, so it lives in the stats and the artifact's own table holds this model's numbers
    ctx.report_from_stats("markdown", "evaluation", "Evaluation vs unigram and Kneser-Ney baselines and previous model",
                          "report_vs_previous")
    kn, prev_kn = res["kn_baseline"], prev and prev.get("kn_baseline")
    ctx.report_table("evaluation-metrics", "Evaluation metrics (this model, the unigram and Kneser-Ney baselines)",
                     metric_rows(res["metrics"], None, base, None, kn, None))
    o = res["metrics"]["overall"]
    ctx.log.info("evaluate: ppl %.4g, bpb %.4g (unigram %.4g, ratio %.3f), acc %.4g on %d tokens (%s)",
                 o["perplexity"], o["bits_per_byte"], base["overall"]["bits_per_byte"],
                 base["bits_per_byte_ratio"] or float("nan"), o["accuracy"], o["tokens"], device)
    ctx.report_stats("evaluation-speed", "Evaluation speed", list(timings))
    # first the figures a stage table shows (it takes the first few): the model's bpb beside the unigram's
    docs = res["metrics"].get("documents") or {}
    stats = {"bits_per_byte": o["bits_per_byte"], "unigram_bits_per_byte": _finite(base["overall"]["bits_per_byte"]),
             "bits_per_byte_vs_unigram": _finite(base["bits_per_byte_ratio"]),
             "kn_bits_per_byte": _finite(kn["overall"]["bits_per_byte"]),
             "bits_per_byte_vs_kn": _finite(kn["bits_per_byte_ratio"]),
             "document_bits_per_byte": _finite(docs.get("bits_per_byte")),
             "document_bits_per_byte_vs_kn": _finite((kn.get("documents") or {}).get("bits_per_byte_ratio")),
             **summary(res["metrics"])}
    stats["report_vs_previous"] = regression_markdown(res["metrics"], prev and prev["metrics"], prev_key,
                                                      same_data, base, prev_base, kn, prev_kn)
    stats.update({"previous_key": prev_key, "device": str(device),
                  "unigram_bits_per_byte": _finite(base["overall"]["bits_per_byte"]),
                  "bits_per_byte_vs_unigram": _finite(base["bits_per_byte_ratio"])})
    stats.update({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in timings.items()})
    if "harness" in res["metrics"]:  # items scored per second through the harness (benchmarks/eval_harness.py)
        items = sum(t["samples"] or 0 for t in res["metrics"]["harness"]["tasks"].values())
        stats["harness_items"] = items
        stats["harness_items_per_s"] = items / timings["harness_seconds"] if timings.get("harness_seconds") else None
    if tuned is not None:
        stats.update(tuned_stats(ctx, tuned))
    if prev is not None:
        p = prev["metrics"]["overall"]
        stats["perplexity_change"] = o["perplexity"] - p["perplexity"]
        stats["bits_per_byte_change"] = o["bits_per_byte"] - p["bits_per_byte"]
    return stats
