"""The ``augment`` stage: add augmented copies of curated documents, with lineage.

Off unless ``augment.enabled``: then the input shards pass through unchanged (hard links), so the
artifact is valid and downstream keys stay meaningful. When on, every operator picks the documents
it touches by a seeded hash of (seed, operator label, document id) below ``fraction``, and each
augmented document gets:

- a new id (hash of parent id, operator label, seed, variant number),
- ``metadata``: the parent's metadata plus ``parent_id``, ``augment_op`` (the label),
  ``augment_type`` and ``augment_seed``.

Output shards keep the input file names: the originals (``keep_originals``) followed by the
augmented documents, in input order; a shard that gains no document is the input file (a hard
link). Shards are cached one by one (``ctx.cached_map``), keyed by the stage version, the config
and the input shard's name and sha256, so a refresh augments only new shards.
Model-based operators name their models by path; the key holds the path, not the weights.
The artifact also holds the shared curation funnel (:mod:`llmpipe.curation.funnel`): ``in`` source
documents, ``kept`` originals, ``added`` children per operator label, ``out`` = kept + added.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.curation.augment.config import (
    AugmentConfig,
    BackTranslationOp,
    ContextualOp,
    RestructureOp,
    SynonymOp,
    TemplateOp,
)
from llmpipe.curation.augment.operators import (
    Outcome,
    Restructurer,
    SynonymReplacer,
    TemplateFiller,
    lang_of,
    relocate,
)
from llmpipe.curation.entities.spans import ENTITIES, check_spans
from llmpipe.curation.funnel import report_funnel
from llmpipe.document import SHARDS, Document, input_shards, read_shard, write_shard
from llmpipe.files import link_file
from llmpipe.lazy import lazy_import
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json

pq = lazy_import("pyarrow.parquet")  # loaded when the stage runs, not when it registers

# 2: an empty shard has no row group (`datasets` reads it); unchanged shards linked
# 3: funnel.json (in, kept, rejected, filters, added per operator, out) and funnel.png
# 4: entity spans kept: never replaced or split, children carry them shifted (documents without spans: as in 3)
VERSION = "4"
BATCH = 64


def unit_hash(*parts: object) -> float:
    """A float in [0, 1) from the parts: the same on every run, machine and Python version."""
    h = hashlib.blake2b("\x00".join(map(str, parts)).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def doc_rng(seed: int, label: str, doc_id: str) -> random.Random:
    h = hashlib.blake2b(f"{seed}\x00{label}\x00{doc_id}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(h, "big"))


def child_id(parent_id: str, label: str, seed: int, variant: int) -> str:
    h = hashlib.blake2b(f"aug\x00{parent_id}\x00{label}\x00{seed}\x00{variant}".encode(), digest_size=12)
    return h.hexdigest()


def build_operator(op: Any, device: str, log: Any = None) -> Any:
    """The runtime object of one configured operator."""
    if isinstance(op, SynonymOp):
        return SynonymReplacer(op)
    if isinstance(op, RestructureOp):
        return Restructurer(op, log)
    if isinstance(op, TemplateOp):
        return TemplateFiller(op)
    from llmpipe.curation.augment.models import BackTranslator, ContextualReplacer

    if isinstance(op, ContextualOp):
        return ContextualReplacer(op, device)
    if isinstance(op, BackTranslationOp):
        return BackTranslator(op, device)
    raise TypeError(f"unknown augment operator {type(op).__name__}")


def augment_documents(docs: list[Document], cfg: AugmentConfig, log: Any = None) -> tuple[list[Document],
                                                                                          dict[str, Any]]:
    """Augmented children of ``docs`` (not including the originals) and per-operator counts."""
    out: list[Document] = []
    stats: dict[str, Any] = {}
    for op in cfg.operators:
        label = op.label
        st = stats[label] = {"type": op.type, "selected": 0, "augmented_docs": 0, "skipped": {}}
        langs = {x.lower() for x in op.languages}
        picked = [d for d in docs if unit_hash(cfg.seed, label, d.id) < op.fraction
                  and (not langs or lang_of(d) in langs)]
        st["selected"] = len(picked)
        if not picked:
            continue
        operator = build_operator(op, cfg.device, log)
        if hasattr(operator, "prepare"):
            operator.prepare(docs)
        for i in range(0, len(picked), BATCH):
            chunk = picked[i : i + BATCH]
            outcomes: list[Outcome] = operator.apply([(d, doc_rng(cfg.seed, label, d.id)) for d in chunk])
            for d, res in zip(chunk, outcomes, strict=True):
                if res.reason is not None or not res.texts:
                    reason = res.reason or "no_output"
                    st["skipped"][reason] = st["skipped"].get(reason, 0) + 1
                    continue
                for v, text in enumerate(res.texts):
                    meta = dict(d.metadata)
                    meta.update(parent_id=d.id, augment_op=label, augment_type=op.type, augment_seed=cfg.seed)
                    if ENTITIES in meta:  # the child's own spans, at their offsets in its text
                        meta[ENTITIES] = res.spans[v] if res.spans is not None else relocate(text, meta[ENTITIES])
                        check_spans(text, meta[ENTITIES], where=f"augment {label} child of {d.id}")
                    out.append(Document(child_id(d.id, label, cfg.seed, v), text, d.source, meta))
                    st["augmented_docs"] += 1
    return out, stats


@dataclass(frozen=True)
class AugmentJob:
    """One shard job: augment the documents of one input shard (``config``'s paths already resolved)."""

    path: str  # the input shard; the output shard has its file name
    config: AugmentConfig


def _augment_shard(job: AugmentJob, out_dir: Path) -> dict[str, Any]:
    path, cfg = job.path, job.config
    docs = read_shard(path)
    children, stats = augment_documents(docs, cfg)
    kept = docs if cfg.keep_originals else []
    if cfg.keep_originals and not children:  # nothing added: the shard is the input file
        link_file(Path(path), out_dir / Path(path).name)
    else:
        write_shard(out_dir / Path(path).name, kept + children)
    return {"docs_in": len(docs), "docs_out": len(kept) + len(children), "operators": stats}


def _merge(total: dict[str, Any], part: dict[str, Any]) -> None:
    for label, st in part.items():
        t = total.setdefault(label, {"type": st["type"], "selected": 0, "augmented_docs": 0, "skipped": {}})
        t["selected"] += st["selected"]
        t["augmented_docs"] += st["augmented_docs"]
        for r, n in st["skipped"].items():
            t["skipped"][r] = t["skipped"].get(r, 0) + n


def resolve_paths(cfg: AugmentConfig, base: Path) -> AugmentConfig:
    """A copy of ``cfg`` whose relative file and model paths point into ``base`` (the config's folder)."""

    def fix(p: str) -> str:
        return p if Path(p).is_absolute() else str((base / p).resolve())

    ops = []
    for op in cfg.operators:
        upd: dict[str, Any] = {}
        if isinstance(op, SynonymOp):
            upd["tables"] = {k: [fix(x) for x in v] for k, v in op.tables.items()}
        elif isinstance(op, ContextualOp):
            upd["model"] = fix(op.model)
        elif isinstance(op, BackTranslationOp):
            upd["chain"] = [fix(x) for x in op.chain]
        elif isinstance(op, TemplateOp) and op.templates_file:
            upd["templates_file"] = fix(op.templates_file)
        ops.append(op.model_copy(update=upd))
    return cfg.model_copy(update={"operators": ops})


def _check_models(cfg: AugmentConfig) -> None:
    from llmpipe.curation.augment.models import check_model_dir

    for i, op in enumerate(cfg.operators):
        if isinstance(op, ContextualOp):
            check_model_dir(op.model, f"augment.operators[{i}].model")
        elif isinstance(op, BackTranslationOp):
            for j, p in enumerate(op.chain):
                check_model_dir(p, f"augment.operators[{i}].chain[{j}]")


def _report(ctx: StageContext, keep_originals: bool, docs_in: int, totals: dict[str, Any]) -> dict[str, Any]:
    """The shared funnel: originals kept (or dropped when ``keep_originals`` is off), children added."""
    kept = docs_in if keep_originals else 0
    added = {k: v["augmented_docs"] for k, v in sorted(totals.items())}
    return report_funnel(ctx, "augment", {
        "in": docs_in, "kept": kept, "rejected": {} if kept == docs_in else {"original_not_kept": docs_in},
        "filters": {}, "added": added, "out": kept + sum(added.values())})


@stage("augment", version=VERSION, inputs=("timeliness",), config_field="augment", flow="data_refresh",
       requires=lambda cfg: ("matplotlib", *(("torch", "transformers") if cfg.augment.enabled and any(
           op.type in ("contextual", "back_translation") for op in cfg.augment.operators) else ())),
       extra="curation")
def run_augment(ctx: StageContext) -> dict[str, Any]:
    """Augment curated documents (synonyms, masked LM, back-translation, restructuring, templates)."""
    cfg: AugmentConfig = ctx.config
    src = ctx.inputs["timeliness"]
    shards = input_shards(src)
    (ctx.out / SHARDS).mkdir(parents=True, exist_ok=True)
    if not cfg.enabled or not cfg.operators:
        n = 0
        for s in shards:
            link_file(s.path, ctx.out / SHARDS / s.name)
            n += pq.ParquetFile(s.path).metadata.num_rows
        _report(ctx, True, n, {})
        ctx.log.info("augment: disabled; %d shards (%d documents) passed through", len(shards), n)
        return {"enabled": False, "shards": len(shards), "docs_in": n, "docs_out": n, "operators": {}}
    key_cfg = cfg.key_dict()  # the paths as written in the config: moving the config keeps the cache
    base = ctx.pipeline.base_dir() if hasattr(ctx.pipeline, "base_dir") else Path.cwd()
    cfg = resolve_paths(cfg, base)
    _check_models(cfg)
    # the name too: the result is a file of that name, and two shards may hold the same bytes (empty ones)
    items = [(hash_json(["augment", VERSION, key_cfg, s.sha256, s.name]), AugmentJob(str(s.path), cfg)) for s in shards]
    results = ctx.cached_map(_augment_shard, items, desc="augment")
    totals: dict[str, Any] = {}
    docs_in = docs_out = 0
    for (d, st), s in zip(results, shards, strict=True):
        link_file(d / s.name, ctx.out / SHARDS / s.name)
        docs_in += st["docs_in"]
        docs_out += st["docs_out"]
        _merge(totals, st["operators"])
    ctx.report_table("augment-operators", "Augmentation per operator", [
        {"operator": k, "type": v["type"], "selected": v["selected"], "augmented_docs": v["augmented_docs"],
         "skipped": ", ".join(f"{r}={n}" for r, n in sorted(v["skipped"].items())) or "-"}
        for k, v in totals.items()])
    funnel = _report(ctx, cfg.keep_originals, docs_in, totals)
    if funnel["out"] != docs_out:
        raise RuntimeError(f"augment: shards hold {docs_out} documents, the funnel counts {funnel['out']}")
    return {"enabled": True, "shards": len(shards), "docs_in": docs_in, "docs_out": docs_out,
            "augmented_docs": sum(v["augmented_docs"] for v in totals.values()), "operators": totals}
