"""Settings of the post-training stages: ``sft`` (instruction tuning) and ``preference`` (DPO).

Both are off unless the config turns them on (``sft.enabled``, ``preference.enabled``): an
ordinary config plans, keys and runs exactly as it did before they existed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from llmpipe.config_base import Section, run_setting
from llmpipe.curation.config import (
    GopherQualitySettings,
    GopherRepetitionSettings,
    LangIdConfig,
    QualityConfig,
    SafetyConfig,
)
from llmpipe.training.config import LaunchConfig

BUILTIN_INSTRUCTIONS = "builtin:instructions"
BUILTIN_PREFERENCES = "builtin:preferences"
MIN_NGRAM = 5  # decontamination windows: shorter ones match common phrases, not copies


def _chat_langid() -> LangIdConfig:
    return LangIdConfig(min_chars=10, default_threshold=0.3)


def _chat_quality() -> QualityConfig:
    return QualityConfig(
        filters=["gopher_quality", "gopher_repetition"],
        gopher_quality=GopherQualitySettings(min_doc_words=None, min_avg_word_length=None,
                                             min_alpha_words_ratio=None, min_stop_words=None),
        gopher_repetition=GopherRepetitionSettings(top_n_grams={}))


class PostTrainDedup(Section):
    """Dedup of records by the dedup stage's normalization and MinHash (in memory: records are few)."""

    exact: bool = Field(True, description="drop records whose normalized text (NFKC, casefold, spaces) repeats")
    near: bool = Field(True, description="drop MinHash LSH near duplicates, verified on shingle Jaccard")
    threshold: float = Field(0.8, gt=0, le=1, description="shingle-set Jaccard from which records are duplicates")
    num_perm: int = Field(128, ge=2, le=1024)
    word_ngram: int = Field(5, ge=1, description="shingle size in words (characters for CJK-like scripts)")
    seed: int = Field(1, ge=0)


class PostTrainCuration(Section):
    """``sft.curation`` / ``preference.curation``: the curation stages' filters on each record's text."""

    langid: LangIdConfig | None = Field(default_factory=_chat_langid, description=(
        "the langid stage's settings (null: off); default: min_chars 10, default_threshold 0.3 for short turns"))
    quality: QualityConfig | None = Field(default_factory=_chat_quality, description=(
        "the quality stage's settings (null: off); default: Gopher's junk and repetition rules, no length minimum"))
    safety: SafetyConfig | None = Field(default_factory=SafetyConfig, description=(
        "the safety stage's settings (null: off): blocklist on the record, PII redacted per field"))
    dedup: PostTrainDedup | None = Field(default_factory=PostTrainDedup, description="null: no dedup")
    bad_records: Literal["error", "quarantine"] = Field("error", description=(
        "a row without the record's keys or of the wrong types: stop naming its file and line (error), or "
        "write it to curation/rejected.jsonl as error:bad_record and go on (quarantine)"))


class SftLaunchConfig(LaunchConfig):
    """``sft.launch``: pretraining's ``train.launch`` with one process by default (the stage's own
    process, no launcher); ``nproc_per_node > 1`` starts that many workers under torchrun."""

    nproc_per_node: int = run_setting(1, gt=0, description=(
        "1: train in the stage's process; more: torchrun workers (llmpipe.posttrain.sft_worker)"))


class SftConfig(Section):
    """``sft``: supervised fine-tuning on prompt/response pairs, loss on response tokens only."""

    enabled: bool = Field(False, description="run the sft stage after pretrain")
    data: list[str] = Field(default_factory=lambda: [BUILTIN_INSTRUCTIONS], min_length=1, description=(
        "instruction sources: JSONL or Parquet files, `datasets` save_to_disk folders (records with "
        "prompt/response or chat messages ending with the assistant's), or builtin:instructions"))
    init_from: str | None = Field(None, description="any causal-LM checkpoint folder to tune instead of the "
                                  "pretrain artifact (its path is in the key, not its bytes)")
    held_out: float = Field(0.1, gt=0, lt=1, description="fraction of pairs (by a hash of the prompt) kept "
                            "out of training to measure the response loss on")
    max_steps: int = Field(60, gt=0, description="optimizer steps")
    batch_size: int = Field(16, gt=0, description="pairs per step")
    lr: float = Field(2e-3, gt=0, description="AdamW peak learning rate (linear decay to 0)")
    weight_decay: float = Field(0.0, ge=0)
    max_length: int = Field(128, gt=8, description="tokens per rendered pair; longer pairs are cut at the end")
    packing: bool = Field(True, description=(
        "lay each step's pairs end to end in rows of max_length tokens, position ids restarting per pair "
        "and attention kept inside each pair (the same pairs and loss per step, less padding computed); "
        "false: one padded row per pair"))
    seed: int = 0
    decontaminate_ngram: int | None = Field(8, ge=MIN_NGRAM, description="drop records sharing a window of this "
                                            "many words with an item of evaluate's built-in tasks (null: keep all)")
    curation: PostTrainCuration = Field(default_factory=PostTrainCuration, description=(
        "langid / quality / safety / dedup on each record's text before decontamination (llmpipe.posttrain.curate)"))
    threads: int = run_setting(0, ge=0, description="torch CPU threads (0: torch's default)")
    # how, not what: each rank computes its share of a step's pairs and the loss is summed over the
    # global batch's response tokens, so any process count and either strategy learn the same weights
    # (tested to 1e-5 against one process); like train.launch and train.parallel, out of the key
    strategy: Literal["ddp", "fsdp2"] = run_setting("ddp", description=(
        "with launch.nproc_per_node > 1: DDP (a whole replica per rank) or FSDP2 (fully_shard per "
        "decoder layer, parameters sharded)"))
    launch: SftLaunchConfig = run_setting(default_factory=SftLaunchConfig, description=(
        "how the workers start (train.launch's settings); torchrun on one node"))

    @model_validator(mode="after")
    def _launchable(self) -> SftConfig:
        lc = self.launch
        if lc.launcher != "torchrun" or lc.nodes != 1:
            raise ValueError(f"sft.launch: sft runs torchrun on one node, got launcher {lc.launcher!r}, nodes {lc.nodes}")
        if self.batch_size < lc.nproc_per_node:
            raise ValueError(f"sft.batch_size ({self.batch_size}) must be at least sft.launch.nproc_per_node "
                             f"({lc.nproc_per_node}): every rank takes a share of each step's pairs")
        return self


class PreferenceConfig(Section):
    """``preference``: DPO (TRL's DPOTrainer) from the sft model against itself, frozen, as reference."""

    enabled: bool = Field(False, description="run the preference stage after sft (needs sft.enabled)")
    data: list[str] = Field(default_factory=lambda: [BUILTIN_PREFERENCES], min_length=1, description=(
        "preference sources: JSONL / Parquet / `datasets` folders with prompt, chosen, rejected; "
        "or builtin:preferences"))
    held_out: float = Field(0.2, gt=0, lt=1, description="fraction of pairs (by a hash of the prompt) kept out "
                            "of training for preference accuracy and reward margin")
    beta: float = Field(0.1, gt=0, description="DPO's beta: how far the policy may move from the reference")
    max_steps: int = Field(40, gt=0, description="optimizer steps")
    batch_size: int = Field(8, gt=0, description="pairs per step")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (linear decay to 0)")
    max_length: int = Field(128, gt=8, description="prompt + completion tokens (longer ones are cut)")
    seed: int = 0
    decontaminate_ngram: int | None = Field(8, ge=MIN_NGRAM, description="drop records sharing a window of this "
                                            "many words with an item of evaluate's built-in tasks (null: keep all)")
    curation: PostTrainCuration = Field(default_factory=PostTrainCuration, description=(
        "langid / quality / safety / dedup on each record's text before decontamination (llmpipe.posttrain.curate)"))
    threads: int = run_setting(0, ge=0, description="torch CPU threads (0: torch's default)")


def check_enabled(sft: SftConfig, preference: PreferenceConfig) -> None:
    """The pipeline config's cross-section rule: DPO starts from the sft model."""
    if preference.enabled and not sft.enabled:
        raise ValueError("preference.enabled: DPO starts from the sft model; set sft.enabled: true too")
