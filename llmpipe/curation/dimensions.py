"""The quality-dimension stages: ``coherence``, ``expertise``, ``diversity``, ``timeliness``.

The seeds' five dimensions, each on the common step shape (:mod:`llmpipe.curation.scored`: score
per shard, decide over the run, write kept and rejected with the scores, one funnel). Safety, the
fifth, is the ``safety`` filter stage (blocklists, PII). In the DAG::

    quality -> coherence -> expertise -> safety -> dedup -> diversity -> timeliness -> augment

Each is off unless its section says ``enabled: true``; off, it passes its input through (hard
links), so switching one on or off changes only the keys from it downstream.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

from llmpipe.curation.dimensions_config import (
    CoherenceConfig,
    DiversityConfig,
    ExpertiseConfig,
    TimelinessConfig,
)
from llmpipe.curation.scored import (
    ScoreFiles,
    pass_through,
    reference_texts,
    resolve_path,
    score_shards,
    stage_stats,
    write_decisions,
)
from llmpipe.document import InputShard, input_shards, iter_documents
from llmpipe.lazy import lazy_import
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json, sha256_file

np = lazy_import("numpy")
pq = lazy_import("pyarrow.parquet")
VERSION = "2"  # 2: shards without dictionaries for ids/texts/metadata; scores.json by orjson (NaN: null)
CURATION_TEXT = ("regex", "rjieba", "sudachipy", "sudachidict_core", "icu", "matplotlib")  # words_of + the funnel chart
MODELS = "models"  # coherence: the ARPA models estimated from the reference sets, <lang>.arpa
EXPERTISE_MODEL = "model/expertise.bin"  # expertise: the classifier trained in the stage
CLUSTERS_JSON, CLUSTERS_PNG = "clusters.json", "clusters.png"  # diversity
YEARS_JSON, YEARS_PNG = "years.json", "years.png"  # timeliness


def _cfg(ctx: StageContext, cls: type) -> Any:
    return ctx.config if ctx.config is not None else cls()


# -- coherence ------------------------------------------------------------------------------------------
def _coherence_requires(pipeline: Any) -> tuple[str, ...]:
    cfg = pipeline.coherence
    if not cfg.enabled:
        return ("matplotlib",)
    binary = any(not str(m).endswith(".arpa") for m in cfg.kenlm_models.values())  # ARPA text scores in Python
    kenlm = binary or cfg.arpa_scorer == "kenlm"
    mods = ("torch", "transformers") if cfg.scorer == "model" else (("kenlm",) if kenlm else ())
    return (*CURATION_TEXT, *mods, *(("sentencepiece",) if cfg.sentencepiece else ()))


def resolve_model(ctx: StageContext, ref: str) -> Path:
    """``store:<stage>/<key>`` (an artifact of this store) or a path -> the checkpoint folder."""
    from llmpipe.evaluation.model_io import HF_CONFIG, find_checkpoint

    if ref.startswith("store:"):
        found = ctx.store.find(ref[len("store:"):]) if ctx.store is not None else None
        art = ctx.store.get(*found) if found else None
        if art is None:
            raise FileNotFoundError(f"coherence.model: {ref}: no such artifact in the store (or a key prefix "
                                    "that is not unique)")
        return find_checkpoint(art.path)
    p = resolve_path(ctx, ref)
    if (p / HF_CONFIG).is_file():
        return p
    return find_checkpoint(p)


def _kenlm_payload(ctx: StageContext, cfg: CoherenceConfig) -> tuple[dict[str, Any], Any]:
    """(payload, score key): model paths per language, the reference models estimated into the artifact."""
    from llmpipe.curation.coherence import build_reference_model

    sp = {lang: str(resolve_path(ctx, p)) for lang, p in cfg.sentencepiece.items()}
    models = {lang: str(resolve_path(ctx, p)) for lang, p in cfg.kenlm_models.items()}
    for lang, p in models.items():
        if not Path(p).is_file():
            raise FileNotFoundError(f"coherence.kenlm_models.{lang}: no model file at {p}")
    for lang, files in sorted(cfg.reference.items()):
        texts = [t for f in files for t in reference_texts(ctx, f, f"coherence.reference.{lang}")]
        models[lang] = str(build_reference_model(texts, lang, ctx.out / MODELS / f"{lang}.arpa", cfg.order,
                                                 sp.get(lang)))
    # scores depend on the models' bytes: a rebuilt reference model (or a replaced file) rescoring
    reader = cfg.resolved_arpa_scorer()  # in the per-shard key too: the two scorers' scores differ slightly
    key = {"models": {lang: sha256_file(Path(p)) for lang, p in sorted(models.items())},
           "sentencepiece": {lang: sha256_file(Path(p)) for lang, p in sorted(sp.items())},
           "default_lang": cfg.default_lang, "arpa_scorer": reader}
    return {"models": models, "sentencepiece": sp, "default_lang": cfg.default_lang, "arpa_scorer": reader}, key


@stage("coherence", version=VERSION, inputs=("quality",), config_field="coherence", flow="data_refresh",
       requires=_coherence_requires, extra="curation")
def run_coherence(ctx: StageContext) -> dict[str, Any]:
    """Coherence: perplexity per language (KenLM, or our own model's bits per byte), head/middle/tail."""
    from llmpipe.curation import coherence

    cfg: CoherenceConfig = _cfg(ctx, CoherenceConfig)
    if not cfg.enabled:
        return pass_through(ctx, "quality")
    shards = input_shards(ctx.inputs["quality"])
    if cfg.scorer == "kenlm":
        payload, key = _kenlm_payload(ctx, cfg)
        fn, metric = coherence.score_kenlm_shard, "perplexity"
    else:
        ckpt = resolve_model(ctx, cfg.model or "")
        payload = {"checkpoint": str(ckpt), "device": cfg.device, "max_tokens": cfg.max_tokens,
                   "batch_size": cfg.batch_size, "default_lang": cfg.default_lang}
        key = {"model": cfg.model, "max_tokens": cfg.max_tokens, "default_lang": cfg.default_lang}
        fn, metric = coherence.score_model_shard, "bits_per_byte"
    scores = score_shards(ctx, shards, fn, payload, key, "coherence scores")
    rule, cuts = coherence.decide(scores, metric, cfg)
    funnel = write_decisions(ctx, shards, scores, rule)
    rows = _bucket_rows(scores, rule)
    ctx.report_table("coherence-buckets", f"coherence: {metric} per language and bucket", rows)
    return stage_stats(funnel, len(shards), scorer=cfg.scorer, metric=metric, buckets=rows,
                       cuts={lang: [round(a, 6), round(b, 6)] for lang, (a, b) in sorted(cuts.items())})


def _bucket_rows(scores: ScoreFiles, rule: Any) -> list[dict[str, Any]]:
    """Documents and the median score per language and bucket, a shard's scores at a time."""
    counts: Counter[tuple[str, str]] = Counter()
    values: dict[tuple[str, str], array[float]] = {}
    for shard in scores:
        for s in shard:
            group = (s["lang"], rule(s).scores.get("bucket") or "unscored")
            counts[group] += 1
            if s[rule.metric] is not None:
                values.setdefault(group, array("d")).append(s[rule.metric])
    return [{"lang": lang, "bucket": b, "docs": n,
             f"median_{rule.metric}": round(float(np.median(np.frombuffer(values[(lang, b)], dtype=np.float64))), 4)
             if (lang, b) in values else None}
            for (lang, b), n in sorted(counts.items())]


# -- expertise --------------------------------------------------------------------------------------------
def _expertise_requires(pipeline: Any) -> tuple[str, ...]:
    cfg = pipeline.expertise
    if not cfg.enabled:
        return ("matplotlib",)
    if cfg.hf_model_path:
        return ("matplotlib", "torch", "transformers")
    return (*CURATION_TEXT, "fasttext", *(("fasttext_new",) if cfg.reference else ()))


def _negatives(shards: list[InputShard], cfg: ExpertiseConfig) -> list[tuple[str, str]]:
    """(text, lang) of a random corpus sample: the ``negatives`` docs first in a seeded hash order."""
    from llmpipe.curation.expertise import sample_key

    picked: list[tuple[int, str, str, str]] = []
    for s in shards:
        for doc in iter_documents(s.path):
            picked.append((sample_key(cfg.train.seed, doc.id), doc.id, doc.text,
                           doc.metadata.get("lang") or cfg.default_lang))
            if len(picked) > 4 * cfg.negatives:  # bounded memory: keep the smallest keys
                picked = sorted(picked)[: cfg.negatives]
    return [(t, lang) for _, _, t, lang in sorted(picked)[: cfg.negatives]]


def _train_expertise(ctx: StageContext, cfg: ExpertiseConfig, shards: list[InputShard]) -> tuple[Path, dict]:
    """Train the classifier into the artifact; its held-out AUC (a result: same data, same number)."""
    from llmpipe.curation import expertise as ex

    pos = [ex.prepare(t, cfg.default_lang) for f in cfg.reference
           for t in reference_texts(ctx, f, "expertise.reference")]
    neg = [ex.prepare(t, lang) for t, lang in _negatives(shards, cfg)]
    pos_tr, pos_ho = ex.split_holdout(pos, cfg.holdout, cfg.train.seed, "pos")
    neg_tr, neg_ho = ex.split_holdout(neg, cfg.holdout, cfg.train.seed, "neg")
    path = ex.train_classifier(pos_tr, neg_tr, cfg.label, ctx.out / EXPERTISE_MODEL, cfg.train)
    model = ex.load_classifier(str(path))
    auc = ex.auc(ex.positive_probability(model, pos_ho, cfg.label), ex.positive_probability(model, neg_ho, cfg.label))
    info = {"positives": len(pos_tr), "negatives": len(neg_tr), "holdout_positives": len(pos_ho),
            "holdout_negatives": len(neg_ho), "holdout_auc": None if math.isnan(auc) else round(auc, 6)}
    (ctx.out / "model" / "training.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return path, info


@stage("expertise", version=VERSION, inputs=("coherence",), config_field="expertise", flow="data_refresh",
       requires=_expertise_requires, extra="curation")
def run_expertise(ctx: StageContext) -> dict[str, Any]:
    """Expertise: a fastText classifier's score (by path, or trained here from a reference set)."""
    from llmpipe.curation import expertise as ex

    cfg: ExpertiseConfig = _cfg(ctx, ExpertiseConfig)
    if not cfg.enabled:
        return pass_through(ctx, "coherence")
    shards = input_shards(ctx.inputs["coherence"])
    info: dict[str, Any] = {}
    if not any(pq.ParquetFile(s.path).metadata.num_rows for s in shards):  # nothing to learn from or to score
        return stage_stats(write_decisions(ctx, shards, [[] for _ in shards], [[] for _ in shards]), len(shards),
                           cut=None, training=info)
    if cfg.hf_model_path:
        ckpt = resolve_path(ctx, cfg.hf_model_path)
        label = ex.hf_label_index(ckpt, cfg.hf_label)  # fail in the parent, naming the key
        payload = {"checkpoint": str(ckpt), "label": label, "max_tokens": cfg.max_tokens}
        key = {"hf_model": cfg.hf_model_path, "label": label, "max_tokens": cfg.max_tokens}
        scores = score_shards(ctx, shards, ex.score_hf_shard, payload, key, "expertise scores")
    else:
        if cfg.model_path:
            path = resolve_path(ctx, cfg.model_path)
            ex.load_classifier(str(path))  # fail in the parent, naming the key, before any shard work
        else:
            path, info = _train_expertise(ctx, cfg, shards)
        payload = {"model": str(path), "label": cfg.label, "default_lang": cfg.default_lang}
        key = {"model": sha256_file(path), "label": cfg.label, "default_lang": cfg.default_lang}
        scores = score_shards(ctx, shards, ex.score_shard, payload, key, "expertise scores")
    rule, cut = ex.decide(scores, cfg)
    funnel = write_decisions(ctx, shards, scores, rule)
    if info:
        ctx.report_table("expertise-training", "expertise classifier (trained in the stage)",
                         [{"metric": k, "value": v} for k, v in info.items()])
    return stage_stats(funnel, len(shards), cut=round(cut, 6), training=info)


# -- diversity --------------------------------------------------------------------------------------------
def _tf_job(arg: tuple[str, int, str], out_dir: Path) -> dict[str, Any]:
    from llmpipe.curation.diversity import term_counts

    shard, features, lang = arg
    return {"docs": term_counts(shard, features, lang, out_dir)}


@stage("diversity", version=VERSION, inputs=("dedup",), config_field="diversity", flow="data_refresh",
       requires=lambda cfg: (*CURATION_TEXT, "scipy", *(("torch", "transformers") if cfg.diversity.encoder else ()))
       if cfg.diversity.enabled else ("matplotlib",),
       extra="curation")
def run_diversity(ctx: StageContext) -> dict[str, Any]:
    """Diversity: TF-IDF k-means clusters; semantic near-duplicates inside clusters; cluster caps."""
    from llmpipe.curation import diversity as dv

    cfg: DiversityConfig = _cfg(ctx, DiversityConfig)
    if not cfg.enabled:
        return pass_through(ctx, "dedup")
    shards = input_shards(ctx.inputs["dedup"])
    lang = ctx.pipeline.quality.default_lang if ctx.pipeline is not None else "en"
    items = [(hash_json([ctx.name, VERSION, "tf", cfg.features, lang, s.sha256]), (str(s.path), cfg.features, lang))
             for s in shards]
    parts = ctx.cached_map(_tf_job, items, desc="diversity terms")
    tf = [d / dv.TF for d, _ in parts]
    idf, sizes = dv.idf_of(tf, cfg.features)
    with tempfile.TemporaryDirectory(prefix=".tmp-diversity-", dir=ctx.out) as work:
        if cfg.encoder:  # the encoder's embeddings decide clusters and duplicates; TF-IDF names the clusters
            texts = [doc.text for s in shards for doc in iter_documents(s.path)]
            v = dv.embed(texts, str(resolve_path(ctx, cfg.encoder)), cfg.encoder_max_length, device=cfg.encoder_device)
            labels = dv.kmeans(v.toarray(), cfg.clusters, cfg.iterations, cfg.seed)
            dup, best = dv.near_duplicates(v, labels, cfg.threshold, max_compared=cfg.max_compared,
                                           iterations=cfg.iterations, seed=cfg.seed)
        else:
            y = dv.sketch_to_file(tf, idf, cfg.sketch_dims, cfg.seed, Path(work) / "sketch.f64")
            labels = dv.kmeans(y, cfg.clusters, cfg.iterations, cfg.seed)
            dup, best = np.full(len(labels), -1, np.int64), np.zeros(len(labels), np.float64)
        k = int(labels.max()) + 1 if len(labels) else 0
        tops: list[list[int]] = [[] for _ in range(k)]
        grouped = dv.ClusterRows(tf, idf, labels, Path(work) / "clusters")
        for j, members, xm in grouped.clusters():  # one cluster's TF-IDF rows in memory at a time
            if not cfg.encoder:
                dv.bounded_duplicates(xm, members, cfg.threshold, dup, best, dv.DUP_BLOCK, cfg.max_compared,
                                      cfg.iterations, cfg.seed)
            tops[j] = dv.distinctive(xm, grouped.overall, cfg.top_terms)
    codes, cap = dv.decide(labels, dup, cfg.max_cluster_share)
    funnel = write_decisions(ctx, shards, None, _shard_decisions(shards, sizes, labels, best, codes, dup))
    terms = dv.name_terms(tops, labels, _texts_of(shards, sizes), cfg.features, lang)
    rows = _cluster_rows(labels, codes, terms)
    (ctx.out / CLUSTERS_JSON).write_text(json.dumps({"cap": cap, "clusters": rows}, indent=1, sort_keys=True,
                                                    ensure_ascii=False))
    _plot_clusters(rows, ctx.out / CLUSTERS_PNG)
    ctx.report_table("diversity-clusters", "diversity: clusters (size, removed, top terms)", rows)
    ctx.report_image("diversity-clusters-chart", "diversity: documents per cluster", ctx.out / CLUSTERS_PNG)
    return stage_stats(funnel, len(shards), clusters=k, cap=cap, vectors="encoder" if cfg.encoder else "tfidf",
                       **{f"rejected_{r}": n for r, n in funnel["rejected"].items()})


def _shard_decisions(shards: list[InputShard], sizes: list[int], labels: Any, best: Any, codes: Any,
                     dup: Any) -> list[Any]:
    """Per shard, its slice of the small arrays and the ids its duplicates point at (read from the
    shards that hold a target, one id column at a time; no id of any other document is held)."""
    from llmpipe.curation.diversity import ShardDecisions

    starts = np.cumsum([0, *sizes])
    targets = np.unique(dup[dup >= 0])
    ids: dict[int, str] = {}
    for k, s in enumerate(shards):
        local = targets[(targets >= starts[k]) & (targets < starts[k + 1])] - starts[k]
        if len(local):
            col = pq.read_table(s.path, columns=["id"]).column("id").take(local).to_pylist()
            ids.update(zip((int(r) + int(starts[k]) for r in local), col, strict=True))
    out = []
    for k in range(len(shards)):
        a, b = int(starts[k]), int(starts[k + 1])
        out.append(ShardDecisions(labels[a:b], best[a:b], codes[a:b],
                                  {int(i) - a: ids[int(dup[i])] for i in np.flatnonzero(dup[a:b] >= 0) + a}))
    return out


def _texts_of(shards: list[InputShard], sizes: list[int]) -> Any:
    """A function: global row indexes -> their (text, lang), read shard by shard."""
    starts = np.cumsum([0, *sizes])

    def get(rows: Any) -> list[tuple[str, str | None]]:
        want = sorted(int(r) for r in rows)
        out = []
        for k, s in enumerate(shards):
            local = {r - int(starts[k]) for r in want if starts[k] <= r < starts[k + 1]}
            if local:
                out.extend((d.text, d.metadata.get("lang")) for j, d in enumerate(iter_documents(s.path))
                           if j in local)
        return out

    return get


def _cluster_rows(labels: Any, codes: Any, terms: list[list[str]]) -> list[dict[str, Any]]:
    k = len(terms)
    by = {r: np.bincount(labels[codes == c], minlength=k) for c, r in enumerate(("kept", "semantic_duplicate",
                                                                                 "cluster_cap"))}
    sizes = np.bincount(labels, minlength=k)
    return [{"cluster": j, "docs": int(sizes[j]), "kept": int(by["kept"][j]),
             "semantic_duplicate": int(by["semantic_duplicate"][j]), "cluster_cap": int(by["cluster_cap"][j]),
             "top_terms": ", ".join(t)} for j, t in enumerate(terms)]


def _plot_clusters(rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars per cluster (kept, duplicates, over the cap); same bytes for the same rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["cluster"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(rows) + 2), 3.5))
    bottom = np.zeros(len(rows))
    for key, color in (("kept", "#4c72b0"), ("semantic_duplicate", "#dd8452"), ("cluster_cap", "#c44e52")):
        v = np.array([r[key] for r in rows], dtype=float)
        ax.bar(xs, v, bottom=bottom, color=color, label=key)
        bottom += v
    ax.set_xlabel("cluster")
    ax.set_ylabel("documents")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)


# -- timeliness -------------------------------------------------------------------------------------------
@stage("timeliness", version=VERSION, inputs=("diversity",), config_field="timeliness", flow="data_refresh",
       requires=("matplotlib",), extra="curation")
def run_timeliness(ctx: StageContext) -> dict[str, Any]:
    """Timeliness: a date per document (metadata, HTML, text); stale or undated rules; recency weights."""
    from llmpipe.curation import timeliness as tl

    cfg: TimelinessConfig = _cfg(ctx, TimelinessConfig)
    if not cfg.enabled:
        return pass_through(ctx, "diversity")
    shards = input_shards(ctx.inputs["diversity"])
    mtimes = tl.source_mtimes(ctx.pipeline) if cfg.file_mtime and ctx.pipeline is not None else {}
    scores = score_shards(ctx, shards, tl.score_shard, (cfg, mtimes), [cfg.key_dict(), mtimes], "timeliness dates")
    funnel = write_decisions(ctx, shards, scores, functools.partial(tl.decide, cfg=cfg))
    years: Counter[str] = Counter()
    origins: Counter[str] = Counter()
    for shard in scores:
        for s in shard:
            years[s["date"][:4] if s["date"] else "undated"] += 1
            origins[(s["origin"] or "none").split(":")[0]] += 1
    rows = [{"year": y, "docs": n} for y, n in sorted(years.items())]
    (ctx.out / YEARS_JSON).write_text(json.dumps({"years": dict(sorted(years.items())),
                                                  "origins": dict(sorted(origins.items()))}, indent=1))
    _plot_years(rows, ctx.out / YEARS_PNG)
    ctx.report_table("timeliness-years", "timeliness: documents per year", rows)
    ctx.report_image("timeliness-years-chart", "timeliness: documents per year", ctx.out / YEARS_PNG)
    return stage_stats(funnel, len(shards), origins=dict(sorted(origins.items())))


def _plot_years(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 0.4 * len(rows) + 2), 3.2))
    ax.bar([r["year"] for r in rows], [r["docs"] for r in rows], color="#4c72b0")
    ax.set_ylabel("documents")
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
