"""Settings of the post-training stages: ``sft`` (instruction tuning) and ``preference`` (DPO).

Both are off unless the config turns them on (``sft.enabled``, ``preference.enabled``): an
ordinary config plans, keys and runs exactly as it did before they existed.
"""

from __future__ import annotations

from pydantic import Field

from llmpipe.config_base import Section, run_setting

BUILTIN_INSTRUCTIONS = "builtin:instructions"
BUILTIN_PREFERENCES = "builtin:preferences"
MIN_NGRAM = 5  # decontamination windows: shorter ones match common phrases, not copies


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
    threads: int = run_setting(0, ge=0, description="torch CPU threads (0: torch's default)")


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
    threads: int = run_setting(0, ge=0, description="torch CPU threads (0: torch's default)")


def check_enabled(sft: SftConfig, preference: PreferenceConfig) -> None:
    """The pipeline config's cross-section rule: DPO starts from the sft model."""
    if preference.enabled and not sft.enabled:
        raise ValueError("preference.enabled: DPO starts from the sft model; set sft.enabled: true too")
