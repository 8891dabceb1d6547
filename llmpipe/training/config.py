"""Config section of the pretrain stage (``train:`` in the YAML).

Fields that decide *what* model comes out (architecture, data order, optimizer, schedule, batch
size, strategy) are part of the stage key. Fields that only decide *how* the run is carried out
(processes per node, nodes, rendezvous, timeouts, checkpoint cadence) are ``run_setting`` and stay
out of the key: the same global batch on 1 node x 2 processes or 2 nodes x 1 process gives the
same model (tested to 1e-5), so it should hit the same cache entry.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting

STRATEGIES = ("ddp", "fsdp2", "deepspeed")


class ModelConfig(Section):
    """A Llama-style decoder: a preset plus optional overrides of any ``LlamaConfig`` field."""

    preset: Literal["tiny", "125m", "1b"] = "tiny"
    overrides: dict[str, Any] = Field(default_factory=dict)
    init_from: str | None = Field(None, description="HF checkpoint folder to continue from (else seeded init)")
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"


class TrainConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    seed: int = 1234
    seq_len: int | None = Field(None, gt=1, description="None: the packed sequence length of the tokenize artifact")
    split: str = "train"

    strategy: Literal["ddp", "fsdp2", "deepspeed"] = "ddp"
    deepspeed: str | dict[str, Any] | None = Field(
        None, description="configs/deepspeed/*.json path or an inline dict (zero_optimization, ...)")

    global_batch_size: int = Field(8, gt=0, description="sequences per optimizer step, all ranks together")
    micro_batch_size: int = Field(2, gt=0, description="sequences per forward pass per rank")
    max_steps: int = Field(20, gt=0)
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(2, ge=0)
    schedule: Literal["cosine", "cosine_restarts", "constant"] = "cosine"
    restart_period: int = Field(0, ge=0, description="steps per cycle for cosine_restarts (0: max_steps/2)")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm (0: off)")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    gradient_checkpointing: bool = False
    compile: bool = False

    # stability guards
    max_consecutive_nonfinite: int = Field(3, gt=0, description="abort after this many non-finite losses in a row")
    spike_factor: float = Field(3.0, gt=1, description="log a spike when loss > factor x running mean")

    # how to run: not part of the key
    device: Literal["auto", "cpu", "cuda"] = run_setting("auto")
    launcher: Literal["torchrun", "deepspeed"] = run_setting("torchrun")
    nproc_per_node: int = run_setting(2, gt=0)
    nodes: int = run_setting(1, gt=0)
    node_rank: int = run_setting(0, ge=0)
    rdzv_endpoint: str | None = run_setting(None, description="host:port of the c10d rendezvous (multi-node)")
    rdzv_id: str | None = run_setting(None, description="job id shared by all nodes (default: the stage key)")
    hostfile: str | None = run_setting(None, description="deepspeed launcher hostfile (multi-node)")
    master_port: int = run_setting(0, ge=0, description="0: pick a free port")
    checkpoint_every: int = run_setting(10, ge=0, description="steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = run_setting(2, gt=0)
    checkpoint_dir: str | None = run_setting(None, description="default: <store>/pretrain/_runs/<key>")
    resume: bool = run_setting(True, description="continue from the newest checkpoint when there is one")
    log_every: int = run_setting(1, gt=0)
    timeout_s: float = run_setting(3600.0, gt=0)
    threads_per_process: int = run_setting(0, ge=0, description="OMP threads per worker (0: cores / processes)")

    @field_validator("deepspeed")
    @classmethod
    def _ds_shape(cls, v: Any) -> Any:
        if isinstance(v, dict) and "zero_optimization" in v and not isinstance(v["zero_optimization"], dict):
            raise ValueError("zero_optimization must be a mapping, e.g. {stage: 2}")
        return v

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                             f"micro_batch_size ({self.micro_batch_size})")
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank must be < nodes ({self.nodes}), got {self.node_rank}")
        if self.nodes > 1 and not (self.rdzv_endpoint or self.hostfile):
            raise ValueError("nodes > 1 needs rdzv_endpoint (torchrun) or hostfile (deepspeed launcher)")
        if self.launcher == "deepspeed" and self.strategy != "deepspeed":
            raise ValueError(f"launcher 'deepspeed' needs strategy 'deepspeed', got {self.strategy!r}")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node
