"""The ``entities`` stage (after safety): entity spans per document in ``metadata["entities"]``.

Each document's language picks its recognizers (``entities.recognizers``: the rule recognizer,
:mod:`~llmpipe.curation.entities.rules`, and a token-classification model,
:mod:`~llmpipe.curation.entities.ner`); their spans merge leftmost-longest, ties to the recognizer
listed first. The tagger is a :class:`~llmpipe.curation.filters.Filter` that keeps every document,
so the stage has the common funnel (every document kept, or quarantined with its error) and counts
entities per label through ``stat_update``: ``funnel.json``'s ``stats["entities"]``. With
``redact`` labels, :class:`~llmpipe.curation.safety.EntityRedactor` then replaces those spans by
placeholders (``stats["pii"]``). ``entities.json`` holds the counts per label and the ``top_k`` most
frequent entity texts per label, also reported as a table. Off (the default), the input shards pass
through as hard links. Shards are cached one by one like the filter stages'.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmpipe.curation.entities.config import EntitiesConfig
from llmpipe.curation.entities.spans import ENTITIES, check_spans, resolve_overlaps
from llmpipe.curation.filters import Filter, FilterChain, FilterResult, check_error_share, first_error
from llmpipe.curation.funnel import check_funnel, merge_funnels, report_funnel
from llmpipe.document import REJECTED, SHARDS, Document, input_shards, iter_documents, write_shard
from llmpipe.files import link_file
from llmpipe.lazy import lazy_import
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json, sha256_file

pq = lazy_import("pyarrow.parquet")
VERSION = "1"
ENTITIES_JSON = "entities.json"  # {"labels": {label: n}, "top": {label: [{"text", "count"}]}}
_SHARD_TOP = 1000  # entity texts per label a shard reports (the stage's top_k come from these)


def _lang(doc: Document) -> str:
    lang = str(doc.metadata.get("lang") or "und")
    return lang.replace("_", "-").split("-")[0].lower()


class EntityTagger(Filter):
    """Keeps every document; writes its spans to ``metadata["entities"]`` and counts them per label."""

    name = "entities"

    def __init__(self, cfg: EntitiesConfig, base: Path | None = None) -> None:
        self.cfg = cfg
        self.recognizers: dict[str, Any] = {}
        if cfg.uses("rules"):
            from llmpipe.curation.entities.rules import RuleRecognizer

            self.recognizers["rules"] = RuleRecognizer(cfg.rules, base)
        if cfg.uses("ner"):
            from llmpipe.curation.entities.ner import TokenClassifier

            self.recognizers["ner"] = TokenClassifier(cfg.ner, _resolve(cfg.ner.model or "", base))
        from llmpipe.curation.safety import PII_RULES

        self.placeholder = re.compile("|".join(sorted({re.escape(r[3]) for r in PII_RULES})))
        self.texts: dict[str, Counter[str]] = {}

    def names_for(self, lang: str) -> list[str]:
        r = self.cfg.recognizers
        return list(r.get(lang, r.get("*", [])))

    def filter(self, doc: Document) -> FilterResult:
        return self.filter_batch([doc])[0]

    def filter_batch(self, docs: Sequence[Document]) -> list[FilterResult]:
        cands: list[list[tuple[int, int, str, float, int]]] = [[] for _ in docs]
        langs = [self.names_for(_lang(d)) for d in docs]
        for name, rec in self.recognizers.items():
            idx = [i for i, names in enumerate(langs) if name in names]
            if not idx:
                continue
            for i, spans in zip(idx, rec.recognize([docs[i].text for i in idx]), strict=True):
                prio = langs[i].index(name)
                cands[i].extend((s["start"], s["end"], s["label"], s["score"], prio) for s in spans)
        found = []
        for doc, c in zip(docs, cands, strict=True):
            if "<" in doc.text:  # safety's placeholders (<EMAIL>) are redactions, never entities
                held = [(m.start(), m.end()) for m in self.placeholder.finditer(doc.text)]
                c = [x for x in c if not any(x[0] < e and s < x[1] for s, e in held)]
            found.append(resolve_overlaps(c, doc.text))
            check_spans(doc.text, found[-1], where=f"document {doc.id}")
        # only now that the whole batch succeeded (a failed batch is retried document by document)
        for doc, spans in zip(docs, found, strict=True):
            doc.metadata[ENTITIES] = spans
            for sp in spans:
                self.stat_update(sp["label"])
                self.texts.setdefault(sp["label"], Counter())[sp["text"]] += 1
        return [True] * len(docs)


def _resolve(path: str, base: Path | None) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() or base is None else base / p)


def build_filters(cfg: EntitiesConfig, base: Path | None = None) -> list[Filter]:
    """The tagger, then the redactor when ``redact`` names labels."""
    from llmpipe.curation.safety import EntityRedactor

    filters: list[Filter] = [EntityTagger(cfg, base)]
    if cfg.redact:
        filters.append(EntityRedactor(cfg.redact))
    return filters


def tag_shard(arg: tuple[str, EntitiesConfig, str], out_dir: Path) -> dict[str, Any]:
    """Tag one input shard (a top-level function: it runs in shard workers)."""
    shard, cfg, base = arg
    filters = build_filters(cfg, Path(base))
    chain = FilterChain(filters)
    kept: list[Document] = []
    rejected: list[Document] = []
    batch: list[Document] = []
    for doc in iter_documents(shard):
        batch.append(doc)
        if len(batch) >= cfg.batch_size:
            k, r = chain.run_batch(batch)
            kept.extend(k)
            rejected.extend(r)
            batch = []
    if batch:
        k, r = chain.run_batch(batch)
        kept.extend(k)
        rejected.extend(r)
    name = Path(shard).name
    write_shard(out_dir / SHARDS / name, kept)
    write_shard(out_dir / REJECTED / name, rejected)
    funnel = chain.funnel()
    check_funnel(funnel, where=shard)
    tagger = filters[0]
    assert isinstance(tagger, EntityTagger)
    funnel["texts"] = {label: c.most_common(_SHARD_TOP) for label, c in sorted(tagger.texts.items())}
    return funnel


def _pass_through(ctx: StageContext) -> dict[str, Any]:
    shards = input_shards(ctx.inputs["safety"])
    n = 0
    for s in shards:
        link_file(s.path, ctx.out / SHARDS / s.name)
        write_shard(ctx.out / REJECTED / s.name, [])
        n += pq.ParquetFile(s.path).metadata.num_rows
    report_funnel(ctx, "entities", {"in": n, "kept": n, "rejected": {}, "filters": {}})
    return {"enabled": False, "docs_in": n, "docs_kept": n, "shards": len(shards)}


def top_entities(funnels: Sequence[dict[str, Any]], k: int) -> dict[str, list[dict[str, Any]]]:
    """The ``k`` most frequent texts per label over the shards (ties by text, so the order is stable)."""
    totals: dict[str, Counter[str]] = {}
    for f in funnels:
        for label, pairs in f.get("texts", {}).items():
            totals.setdefault(label, Counter()).update(dict(pairs))
    return {label: [{"text": t, "count": n} for t, n in sorted(c.items(), key=lambda x: (-x[1], x[0]))[:k]]
            for label, c in sorted(totals.items())}


def _requires(pipeline: Any) -> tuple[str, ...]:
    cfg: EntitiesConfig = pipeline.entities
    mods: tuple[str, ...] = ("matplotlib",)
    if cfg.enabled and cfg.uses("rules"):
        mods += ("regex",)
    if cfg.enabled and cfg.uses("ner"):
        mods += ("torch", "transformers")
    return mods


@stage("entities", version=VERSION, inputs=("safety",), config_field="entities", flow="data_refresh",
       requires=_requires, extra="curation")
def run_entities(ctx: StageContext) -> dict[str, Any]:
    """Entity recognition: rule patterns, gazetteers, a token-classification model; spans in metadata."""
    cfg: EntitiesConfig = ctx.config if ctx.config is not None else EntitiesConfig()
    if not cfg.enabled:
        return _pass_through(ctx)
    base = ctx.pipeline.base_dir() if hasattr(ctx.pipeline, "base_dir") else Path.cwd()
    if cfg.uses("ner"):
        from llmpipe.curation.entities.ner import check_model_dir

        check_model_dir(_resolve(cfg.ner.model or "", base))
    build_filters(cfg, base)  # fail fast in the parent on a bad gazetteer or model
    # what the output depends on beyond the config: the gazetteers' and the model's bytes
    files = {p: sha256_file(Path(_resolve(p, base))) for p in cfg.rules.gazetteers}
    if cfg.uses("ner"):
        mdir = Path(_resolve(cfg.ner.model or "", base))
        files.update({f"ner/{f.name}": sha256_file(f) for f in sorted(mdir.iterdir()) if f.is_file()})
    key_cfg = cfg.key_dict()
    shards = input_shards(ctx.inputs["safety"])
    items = [(hash_json(["entities", VERSION, key_cfg, files, s.sha256, s.name]), (str(s.path), cfg, str(base)))
             for s in shards]
    results = ctx.cached_map(tag_shard, items, desc="entities shards")
    for (d, _st), s in zip(results, shards, strict=True):
        for sub in (SHARDS, REJECTED):
            link_file(d / sub / s.name, ctx.out / sub / s.name)
    parts = [st for _, st in results]
    merged = merge_funnels(parts)
    check_error_share(merged, cfg.max_error_share, "entities.max_error_share", lambda: first_error(ctx.out))
    funnel = report_funnel(ctx, "entities", merged)
    labels = funnel.get("stats", {}).get("entities", {})
    top = top_entities(parts, cfg.top_k)
    (ctx.out / ENTITIES_JSON).write_text(json.dumps({"labels": labels, "top": top}, indent=1, sort_keys=True,
                                                    ensure_ascii=False))
    ctx.report_table("entities-labels", "entities: spans per label",
                     [{"label": k, "count": v} for k, v in sorted(labels.items(), key=lambda x: (-x[1], x[0]))])
    ctx.report_table("entities-top", f"entities: the {cfg.top_k} most frequent per label",
                     [{"label": label, "rank": i + 1, **row} for label, rows in top.items()
                      for i, row in enumerate(rows)])
    for filter_name, counts in funnel.get("stats", {}).items():
        if filter_name != "entities":  # pii: redactions per label
            ctx.report_table(f"entities-{filter_name}", f"entities: {filter_name} counts",
                             [{"key": k, "count": v} for k, v in counts.items()])
    ctx.log.info("entities: %d spans in %d documents (%d shards)", sum(labels.values()), funnel["in"], len(items))
    return {"enabled": True, "docs_in": funnel["in"], "docs_kept": funnel["kept"], "rejected": funnel["rejected"],
            "labels": labels, "shards": len(items), "filter_stats": funnel.get("stats", {})}
