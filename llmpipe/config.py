"""The pipeline config: one YAML file declares the sources, the store and every stage's settings.

Load with :func:`load_config`, which applies dotted ``key=value`` overrides
(``train.optimizer.lr=3e-4``) and turns every validation error into one line naming the file, the
dotted key path and the reason::

    configs/x.yaml: dedup.threshold: must be in (0, 1], got 1.5
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from llmpipe.config_base import Section, run_setting
from llmpipe.curation.augment.config import AugmentConfig
from llmpipe.curation.config import DedupConfig, LangIdConfig, QualityConfig, SafetyConfig
from llmpipe.curation.dimensions_config import (
    CoherenceConfig,
    DiversityConfig,
    ExpertiseConfig,
    TimelinessConfig,
)
from llmpipe.curation.entities.config import EntitiesConfig
from llmpipe.evaluation.config import EvaluateConfig
from llmpipe.posttrain.config import PreferenceConfig, SftConfig, check_enabled
from llmpipe.quantization.config import QuantizeConfig
from llmpipe.serving.config import DeployConfig
from llmpipe.tokenization.config import TokenizeConfig, TokenizerConfig
from llmpipe.training.config import TrainConfig


class ConfigError(ValueError):
    """A config that cannot run; the message names the file, the key path and the reason."""


SourceFormat = Literal["auto", "jsonl", "parquet", "text", "text_lines", "hf_disk", "builtin"]


class SourceConfig(Section):
    """One input: a file, a folder or a glob, in one of the supported formats."""

    name: str = Field(min_length=1, description="unique name; part of every document's id and lineage")
    path: str = Field(min_length=1, description="file, folder or glob (relative to the config's folder), or "
                      "an fsspec URL of one (s3://bucket/crawl/**/*.jsonl: read where it lives); "
                      "'builtin:tiny' for the shipped corpus")
    format: SourceFormat = Field("auto", description="auto: by extension (.jsonl[.gz|.zst], .parquet, .txt) "
                                 "or a `save_to_disk` folder; text: one doc per file; text_lines: one per line")
    text_field: str = Field("text", description="JSON key / column holding the text")
    id_field: str | None = Field(None, description="JSON key / column with the record's own id (kept as orig_id)")
    glob: str = Field("**/*", description="files to take inside a folder")
    unknown_files: Literal["error", "quarantine"] = Field(
        "error", description="a file in a folder or glob whose type its name does not tell (b.jsonl.bz2): "
        "error names them all before any work; quarantine puts one quarantine line per file and goes on")

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not v.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"must contain only letters, digits, '-' and '_', got {v!r}")
        return v


class IngestConfig(Section):
    normalization: Literal["NFC", "NFKC", "none"] = Field("NFC", description="Unicode normalization form")
    strip_control: bool = Field(True, description="remove control characters (keeps newline and tab)")
    min_chars: int = Field(1, ge=0, description="shorter texts (after stripping) are quarantined as empty")
    max_docs_per_shard: int = Field(20000, gt=0, description="documents per output Parquet shard")
    chunk_mb: float = Field(16.0, gt=0, description="uncompressed JSONL files are split into chunks of this size")
    sample: float | None = Field(None, gt=0, lt=1, description="keep only this fraction of each source, the "
                                 "same documents every time (by a hash of the document id): `llmpipe run "
                                 "--sample` sets it for a smoke run")


class ExecutorConfig(Section):
    """How shard-level work runs. None of it changes what the stages produce (not in any key)."""

    kind: Literal["local", "dask"] = Field("local", description="shard-level work on a local process pool "
                                           "or a Dask cluster")
    workers: int = Field(2, gt=0, description="local processes for shard-level work (threads where "
                         "the work releases the GIL: tokenize's encode)")
    dask_address: str | None = Field(None, description="scheduler of an existing Dask cluster "
                                     "(tcp://host:8786); None starts a LocalCluster")
    dask_workers: int = Field(2, gt=0, description="workers of the LocalCluster llmpipe starts")
    dask_threads_per_worker: int = Field(1, gt=0, description="threads per LocalCluster worker")


class PipelineConfig(Section):
    name: str = Field("llmpipe", description="the pipeline's name (run records, model names)")
    store: str = Field(".llmpipe/store", description="artifact store root: a path or an fsspec URL")
    state_dir: str = Field(".llmpipe", description="local state: Prefect home, source hash cache, "
                           "built-in corpus, remote-store cache")
    sources: list[SourceConfig] = Field(default_factory=list, description="the raw inputs, at least one (keys of each entry: sources[].*)")
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    langid: LangIdConfig = Field(default_factory=LangIdConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    coherence: CoherenceConfig = Field(default_factory=CoherenceConfig)
    expertise: ExpertiseConfig = Field(default_factory=ExpertiseConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    entities: EntitiesConfig = Field(default_factory=EntitiesConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    diversity: DiversityConfig = Field(default_factory=DiversityConfig)
    timeliness: TimelinessConfig = Field(default_factory=TimelinessConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)

    # where the config came from: relative source paths resolve against its folder
    config_path: str | None = run_setting(None)

    @model_validator(mode="after")
    def _unique_sources(self) -> PipelineConfig:
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sources: names must be unique, repeated: {', '.join(dup)}")
        check_enabled(self.sft, self.preference)
        return self

    def base_dir(self) -> Path:
        return Path(self.config_path).resolve().parent if self.config_path else Path.cwd()


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a","b","c"], value parsed as YAML: numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. train.max_steps=100")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads 3e-4 as a string
    return parts, value


def _looks_like_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return any(c in s.lower() for c in "e.") and s.lower() not in ("nan", "inf", "-inf")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node: Any = data
        for p in parts[:-1]:
            if isinstance(node, list) and p.isdigit():
                node = node[int(p)]
                continue
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = node.setdefault(p, {})
            if node is None:
                node = {}
        if isinstance(node, list) and parts[-1].isdigit():
            node[int(parts[-1])] = value
        elif isinstance(node, dict):
            node[parts[-1]] = value
        else:
            raise ConfigError(f"override {item!r}: cannot set a key inside a value")
    return data


# keys an earlier release used -> where they live now (a config written for it gets the new name);
# dotted paths from the top, "[]" for any list entry (sources[].x)
RENAMED_KEYS: dict[str, str] = {
    "runner": "executor",
    # train: in sub-sections (pretrain stage version 3); train.schedule, once the kind, has its own error
    "train.lr": "train.optimizer.lr", "train.weight_decay": "train.optimizer.weight_decay",
    "train.betas": "train.optimizer.betas", "train.eps": "train.optimizer.eps",
    "train.grad_clip": "train.optimizer.grad_clip",
    "train.warmup_steps": "train.schedule.warmup_steps", "train.min_lr_ratio": "train.schedule.min_lr_ratio",
    "train.restart_period": "train.schedule.restart_period",
    "train.max_consecutive_nonfinite": "train.guards.max_consecutive_nonfinite",
    "train.spike_factor": "train.guards.spike_factor",
    "train.checkpoint_every": "train.checkpoint.every", "train.keep_checkpoints": "train.checkpoint.keep",
    "train.checkpoint_dir": "train.checkpoint.dir", "train.resume": "train.checkpoint.resume",
    "train.device": "train.launch.device", "train.launcher": "train.launch.launcher",
    "train.nproc_per_node": "train.launch.nproc_per_node", "train.nodes": "train.launch.nodes",
    "train.node_rank": "train.launch.node_rank", "train.rdzv_endpoint": "train.launch.rdzv_endpoint",
    "train.rdzv_id": "train.launch.rdzv_id", "train.hostfile": "train.launch.hostfile",
    "train.master_port": "train.launch.master_port", "train.timeout_s": "train.launch.timeout_s",
    "train.threads_per_process": "train.launch.threads_per_process",
}


def renamed_key(loc: tuple[Any, ...]) -> str | None:
    """The new name of the key at a pydantic error location, or None; list indices match "[]"."""
    path = "".join("[]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    return RENAMED_KEYS.get(path)


def _format_errors(origin: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        new = renamed_key(e["loc"]) if e["type"] == "extra_forbidden" else None
        if new is not None and isinstance(e.get("input"), dict):
            msg = f"renamed to {new!r} (same keys below it)"
        elif new is not None:
            msg = f"moved to {new!r}"
        elif e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see docs/config-reference.md)"
        elif "input" in e and e["type"] not in ("missing",) and "got" not in msg:
            msg = f"{msg}, got {e['input']!r}"
        lines.append(f"{origin}: {loc}: {msg}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict[str, Any] | None = None) -> PipelineConfig:
    """Read, override and validate a pipeline config; raise ConfigError with file and key on failure."""
    origin = str(path) if path is not None else "<config>"
    if data is None:
        if path is None:
            data = {}
        else:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{origin}: no such config file")
            try:
                data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{origin}: invalid YAML: {e}") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{origin}: top level must be a mapping, got {type(data).__name__}")
    data = json.loads(json.dumps(data, default=str))  # deep copy, plain types
    data = apply_overrides(data, list(overrides or []))
    if path is not None:
        data["config_path"] = str(Path(path).resolve())
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(origin, e)) from None
