"""Config sections of the quality-dimension stages: coherence, expertise, diversity, timeliness.

Each is off unless ``enabled: true`` (then its input passes through unchanged, hard-linked).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting

Bucket = Literal["head", "middle", "tail"]


class CoherenceConfig(Section):
    """Perplexity under a reference LM per language (``llmpipe.curation.coherence``)."""

    enabled: bool = False
    scorer: Literal["kenlm", "model"] = Field(
        "kenlm", description="kenlm: n-gram models per language (perplexity); model: our own causal LM "
        "(bits per byte)")
    kenlm_models: dict[str, str] = Field(
        default_factory=dict, description="KenLM model (.arpa or binary) per language {en: en.arpa.bin}")
    reference: dict[str, list[str]] = Field(
        default_factory=dict, description="reference documents per language (.txt: one per line, .jsonl: "
        "`text`) from which the stage estimates its own KenLM model, kept in the artifact")
    order: int = Field(3, ge=1, le=6, description="n-gram order of the models estimated from `reference`")
    arpa_scorer: Literal["auto", "kenlm", "python"] = Field(
        "auto", description="what scores with the n-gram models: kenlm (the compiled package, the "
        "`[coherence]` extra), python (a reader of ARPA text models: the same key on every install), or auto "
        "(kenlm when installed); the two agree to about 1e-5 in log10, so the choice is part of the key")
    sentencepiece: dict[str, str] = Field(
        default_factory=dict, description="SentencePiece model per language, for KenLM models trained on its "
        "pieces (CCNet's); otherwise words")
    model: str | None = Field(
        None, description="scorer model: a checkpoint folder or `store:<stage>/<key>` (a pretrain or quantize "
        "artifact of this store)")
    max_tokens: int = Field(1024, gt=0, description="scorer model: tokens scored per document (its first ones)")
    default_lang: str = Field("en", description="language assumed when a doc has no `lang`")
    rule: Literal["buckets", "threshold"] = Field(
        "buckets", description="buckets: CCNet's head/middle/tail percentiles over the run; threshold: max_score")
    buckets: list[float] = Field(
        default_factory=lambda: [30.0, 60.0], description="the two percentiles (per language) that cut head | "
        "middle | tail")
    keep: dict[str, list[Bucket]] = Field(default_factory=dict, description="buckets kept per language")
    default_keep: list[Bucket] = Field(default_factory=lambda: ["head", "middle"],
                                       description="buckets kept for languages not in `keep`")
    max_score: dict[str, float] = Field(
        default_factory=dict, description="threshold rule: highest perplexity (kenlm) or bits per byte (model) "
        "kept, per language")
    default_max_score: float | None = Field(None, description="threshold for languages not in `max_score`")
    unscored: Literal["keep", "drop"] = Field(
        "keep", description="documents with no model for their language or no words")
    device: str = run_setting("cpu", description="scorer model: cpu | cuda | auto")
    batch_size: int = run_setting(8, gt=0, description="scorer model: documents per forward pass")

    @field_validator("buckets")
    @classmethod
    def _cuts(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not 0 <= v[0] <= v[1] <= 100:
            raise ValueError(f"must be two percentiles 0 <= head <= tail <= 100, got {v}")
        return v

    @model_validator(mode="after")
    def _scorer(self) -> CoherenceConfig:
        if self.enabled and self.scorer == "model" and not self.model:
            raise ValueError("scorer 'model' needs `model` (a checkpoint folder or store:<stage>/<key>)")
        both = sorted(set(self.kenlm_models) & set(self.reference))
        if both:
            raise ValueError(f"languages {both} have both a kenlm_models path and a reference set: pick one")
        if self.enabled and self.scorer == "kenlm" and not (self.kenlm_models or self.reference):
            raise ValueError("scorer 'kenlm' needs kenlm_models or reference (per language)")
        if self.enabled and self.scorer == "kenlm" and self.arpa_scorer == "kenlm" and not _has_kenlm():
            raise ValueError("arpa_scorer 'kenlm' needs the kenlm package: pip install 'llmpipe[coherence]' "
                             "(builds it with a C++ compiler), or arpa_scorer: python")
        return self

    def resolved_arpa_scorer(self) -> Literal["kenlm", "python"]:
        """Which scorer reads the n-gram models on this install (``auto``: kenlm when it imports)."""
        if self.arpa_scorer == "auto":
            return "kenlm" if _has_kenlm() else "python"
        return self.arpa_scorer

    def key_dict(self) -> dict[str, Any]:
        """The settings, and which ARPA scorer scores: the compiled ``kenlm`` and the Python ``ArpaModel``
        agree to about 1e-5 in log10, not bit for bit, so the scores (and the artifact's bytes) depend on
        it. Under ``auto`` installing ``[coherence]`` changes the key instead of the bytes under one; a
        pinned scorer gives one key on every install (``make run`` without KenLM, ``make test`` with it)."""
        out = super().key_dict()
        out.pop("arpa_scorer")  # in the key only where it scores, resolved: auto's keys stay as they were
        if self.enabled and self.scorer == "kenlm":
            out["arpa_scorer"] = self.resolved_arpa_scorer()
        return out


class FastTextSettings(Section):
    """fastText supervised training (``train_supervised``), one thread: the same model bytes every run."""

    epoch: int = Field(10, gt=0)
    lr: float = Field(0.5, gt=0)
    dim: int = Field(32, gt=0)
    word_ngrams: int = Field(2, ge=1)
    min_count: int = Field(1, ge=1)
    bucket: int = Field(1 << 18, ge=0, description="hash buckets of word n-grams (fastText's 2M makes 256 MB)")
    seed: int = Field(0, ge=0)


class ExpertiseConfig(Section):
    """A document classifier's score (``llmpipe.curation.expertise``), DCLM / FineWeb-Edu style."""

    enabled: bool = False
    model_path: str | None = Field(None, description="an existing fastText supervised model (.bin / .ftz)")
    hf_model_path: str | None = Field(
        None, description="or a transformers sequence-classification checkpoint folder; the score is the "
        "softmax probability of `hf_label`")
    hf_label: str | int = Field(1, description="hf_model_path: the positive class, a name of the model's id2label "
                                "or an index")
    max_tokens: int = Field(512, gt=0, description="hf_model_path: tokens scored per document (its first ones)")
    reference: list[str] = Field(
        default_factory=list, description="positive documents to train from (.txt: one per line, .jsonl: "
        "`text`, or builtin:pydoc, Python's reference manual); the negatives are a random sample of the corpus")
    label: str = Field("__label__hq", description="the positive label; the score is its probability")
    negatives: int = Field(2000, gt=0, description="corpus documents sampled as negatives (seeded by id)")
    holdout: float = Field(0.1, ge=0, lt=1, description="share of both sets held out to report the AUC")
    train: FastTextSettings = Field(default_factory=FastTextSettings)
    rule: Literal["threshold", "top_fraction"] = "threshold"
    threshold: float = Field(0.5, ge=0, le=1, description="lowest score kept (threshold rule)")
    top_fraction: float = Field(0.5, gt=0, le=1, description="share of documents kept, best first")
    default_lang: str = "en"

    @model_validator(mode="after")
    def _source(self) -> ExpertiseConfig:
        if self.enabled and sum(map(bool, (self.model_path, self.hf_model_path, self.reference))) != 1:
            raise ValueError("set exactly one of model_path (a fastText model), hf_model_path (a transformers "
                             "classifier) and reference (train a fastText model here)")
        return self


class DiversityConfig(Section):
    """Semantic clusters (``llmpipe.curation.diversity``): near-duplicates inside clusters, cluster caps."""

    enabled: bool = False
    features: int = Field(1 << 18, ge=256, description="hashed TF-IDF features (word 1-2-grams, CJK "
                          "character 1-2-grams)")
    sketch_dims: int = Field(256, ge=8, description="dense dimensions k-means clusters in (count sketch)")
    clusters: int = Field(16, ge=1, description="k of k-means (fewer when there are fewer documents)")
    iterations: int = Field(25, ge=1)
    seed: int = Field(0, ge=0)
    threshold: float | None = Field(0.9, description="cosine similarity from which two docs of a cluster are "
                                    "duplicates (the earliest is kept); None = no semantic dedup")
    max_compared: int = Field(20_000, ge=2, description="documents compared with each other at most: a larger "
                              "cluster is split for the duplicate step (k-means on its rows, then runs in corpus "
                              "order), so the step costs at most n x max_compared cosines, not n^2 / clusters")
    max_cluster_share: float | None = Field(None, description="most of the kept documents one cluster may hold "
                                            "(earliest kept); None = no cap")
    top_terms: int = Field(8, ge=1, description="terms reported per cluster")
    encoder: str | None = Field(None, description="a sentence-embedding or encoder checkpoint folder "
                                "(transformers AutoModel): its mean-pooled states instead of TF-IDF vectors")
    encoder_max_length: int = Field(256, ge=8, description="encoder: tokens read per document (its first ones)")
    encoder_device: str = run_setting("cpu", description="encoder: torch device")

    @field_validator("threshold", "max_cluster_share")
    @classmethod
    def _unit(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v


class TimelinessConfig(Section):
    """Document dates (``llmpipe.curation.timeliness``): drop stale documents or weight by recency."""

    enabled: bool = False
    date_fields: list[str] = Field(
        default_factory=lambda: ["date", "published", "metadata.date"],
        description="metadata paths tried first, in order (ISO dates or epoch seconds)")
    from_text: bool = Field(True, description="else find a date in the text (HTML meta tags, then the text)")
    file_mtime: bool = Field(False, description="else the source file's modification date (not in the stage "
                             "key: a touched file is re-dated when the stage reruns)")
    reference_date: dt.date | None = Field(
        None, description="the date ages are measured from (never the clock: the key must not change daily)")
    max_age_days: int | None = Field(None, gt=0, description="drop documents older than this (reason `stale`)")
    half_life_days: float | None = Field(
        None, gt=0, description="metadata `recency_weight` = 0.5 ** (age / half_life): tokenize "
                             "multiplies the document's train sampling factor by it (`tokenize.recency_weighting`)")
    undated: Literal["keep", "drop"] = Field("keep", description="documents with no date")
    undated_weight: float = Field(1.0, ge=0, description="recency_weight of undated documents")
    min_year: int = Field(1990, description="earlier dates found in text are not taken as dates")

    @model_validator(mode="after")
    def _reference(self) -> TimelinessConfig:
        if (self.max_age_days or self.half_life_days) and self.reference_date is None:
            raise ValueError("max_age_days and half_life_days need reference_date (a fixed date, never today)")
        return self


def _has_kenlm() -> bool:
    try:
        import kenlm  # noqa: F401
    except ImportError:
        return False
    return True
