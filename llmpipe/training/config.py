"""Config section of the pretrain stage (``train:`` in the YAML), in sub-sections the way torchtitan
groups its job config.

``train:`` itself holds what defines the run as a whole (seed, data, strategy, batch sizes, steps,
precision); ``model``, ``optimizer``, ``schedule`` and ``guards`` hold the rest of what decides *what*
model comes out, and are part of the stage key. ``checkpoint`` and ``launch`` only decide *how* the
run is carried out (cadence, processes per node, nodes, rendezvous, timeouts): every field in them
is a ``run_setting`` and stays out of the key, because the same global batch on 1 node x 2
processes or 2 nodes x 1 process gives the same model (tested to 1e-5) and should hit the same
cache entry.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting


class ModelConfig(Section):
    """A Llama-style decoder: a preset plus optional overrides of any ``LlamaConfig`` field."""

    preset: Literal["tiny", "125m", "1b"] = "tiny"
    overrides: dict[str, Any] = Field(default_factory=dict)
    init_from: str | None = Field(None, description="HF checkpoint folder to continue from (else seeded init)")
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"


class OptimizerConfig(Section):
    """AdamW with decoupled weight decay (matrices only, not norms or biases) and global-norm clipping."""

    lr: float = Field(3e-4, gt=0, description="peak learning rate (after warmup)")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm (0: off)")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class ScheduleConfig(Section):
    """The learning rate per step: linear warmup to ``optimizer.lr``, then ``kind`` down to the floor.

    ``wsd`` (warmup-stable-decay) holds the peak until the last ``decay_steps`` (or ``decay_ratio`` of
    ``max_steps``) and decays linearly to the floor there: the stable phase does not depend on
    ``max_steps``, so a run checkpointed in it continues as a longer run (a larger ``max_steps``, the
    same ``checkpoint.dir``) with the learning rates it would have had from the start.
    """

    kind: Literal["cosine", "cosine_restarts", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(2, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the floor of the cosine, as a fraction of lr")
    restart_period: int = Field(0, ge=0, description="steps per cycle for cosine_restarts (0: max_steps/2)")
    decay_steps: int = Field(0, ge=0, description="wsd: steps of the final linear decay (0: decay_ratio x max_steps)")
    decay_ratio: float = Field(0.2, gt=0, le=1, description="wsd: the decay's share of max_steps when "
                                                            "decay_steps is 0")


class GuardsConfig(Section):
    """Stability guards: a non-finite loss skips its step; too many in a row abort the run.

    With fp16 the loss scaler skips a step whose gradients overflowed and halves its scale; the two
    warning thresholds (run settings: they only warn) say when mixed precision has stopped training.
    """

    max_consecutive_nonfinite: int = Field(3, gt=0, description="abort after this many non-finite losses in a row")
    spike_factor: float = Field(3.0, gt=1, description="log a spike when loss > factor x running mean")
    loss_scale_floor: float = run_setting(1.0, gt=0, description="fp16: warn when the loss scale falls below this")
    overflow_skips_warn: int = run_setting(5, gt=0, description="fp16: warn when the loss scaler skipped this "
                                           "many steps in a row (gradient overflow)")


class LrFindConfig(Section):
    """``train.lr_find``: run the LR finder (``llmpipe lr-find``) on the stage's model and data first and
    train with its suggestion instead of ``optimizer.lr`` (the schedule's peak). Part of the key: the
    sweep decides the learning rate, so its settings decide the model."""

    enabled: bool = Field(False, description="sweep first, then train with the suggested learning rate")
    min_lr: float = Field(1e-5, gt=0, description="first learning rate of the sweep")
    max_lr: float = Field(1.0, gt=0, description="last learning rate of the sweep")
    steps: int = Field(100, ge=10, description="sweep length in steps (it stops early once the loss diverges)")

    @model_validator(mode="after")
    def _range(self) -> LrFindConfig:
        if self.min_lr >= self.max_lr:
            raise ValueError(f"min_lr ({self.min_lr:g}) must be below max_lr ({self.max_lr:g})")
        return self


class CheckpointConfig(Section):
    """Where and how often the run saves its state; a killed run resumes from the newest checkpoint."""

    every: int = run_setting(10, ge=0, description="steps between checkpoints (0: only at the end)")
    keep: int = run_setting(2, gt=0, description="newest checkpoints kept")
    dir: str | None = run_setting(None, description="default: <store>/pretrain/_runs/<key>")
    resume: bool = run_setting(True, description="continue from the newest checkpoint when there is one")
    async_save: bool = run_setting(True, description="DCP engines (DDP, FSDP2, tensor parallel) write checkpoints "
                                   "in the background while training goes on (dcp.async_save; a CPU copy of "
                                   "each rank's state); DeepSpeed and pipeline stages save synchronously")


class LossConfig(Section):
    """The training loss. Off (``entity_weight: null``): plain cross-entropy, exactly as without it.

    ``entity_weight`` switches on the entity loss, which needs ``tokenize.entity_mask: true`` (and the
    entities stage) so the packed data carries which targets overlap an entity span:
    ``weighted`` scales the cross-entropy of entity targets by ``entity_weight`` (a weighted mean over
    all targets: the well-posed form of the field guide's "entity reward"); ``seed_reward`` is the
    guide's own form, ``alpha * CE - (1 - alpha) * mean p(target) over entity targets``. That one is
    no longer a cross-entropy: it goes below zero, the reward can be bought by moving probability onto
    entity targets whatever the rest of the text does, and the guards (spikes, the running mean) read
    it as they would a CE. Keep ``1 - alpha`` small.
    """

    kind: Literal["weighted", "seed_reward"] = "weighted"
    entity_weight: float | None = Field(None, gt=0, description="weight of entity targets' cross-entropy; "
                                        "None: plain cross-entropy")
    alpha: float = Field(0.9, ge=0, le=1, description="seed_reward: the weight of the cross-entropy term")
    chunk_tokens: int = Field(4096, ge=0, description="without a compiled model on a GPU: plain cross-entropy "
                              "in chunks of this many tokens, each upcast to fp32 and recomputed in backward "
                              "(never fp32 logits of the whole vocabulary for every token); 0: in one piece. "
                              "A compiled model on a GPU compiles the loss whole instead (Inductor fuses the "
                              "upcast; measured faster than both)")


class WatchConfig(Section):
    """What the run reports about itself beyond the loss (``llmpipe/training/watch.py``)."""

    leak_window: int = run_setting(20, ge=0, description="warn when memory rose at nearly every step of "
                                   "this many steps (0: off)")
    leak_min_mb: float = run_setting(64.0, gt=0, description="less growth over the window is not a leak")
    tensorboard: bool = run_setting(True, description="TensorBoard event files in <run>/tensorboard/")


class ProfileConfig(Section):
    """Steps traced with ``torch.profiler`` (Chrome trace JSON in ``<run>/profile/``)."""

    steps: list[int] = run_setting(default_factory=list, description="1-based steps to trace, e.g. [10, 11, 12]")

    @field_validator("steps")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(s < 1 for s in v):
            raise ValueError(f"steps are 1-based and must be positive, got {v}")
        return v


class ParallelConfig(Section):
    """Model parallelism inside the data-parallel strategy (``llmpipe/training/parallel.py``).

    ``tensor: N`` splits every decoder block over N ranks with PyTorch DTensor, as torchtitan does
    (column-wise q/k/v/gate/up, row-wise o/down: the plan transformers ships with the model as
    ``config.base_model_tp_plan``); the world is then a (data x tensor) mesh, world / N data-parallel
    replicas of N ranks each, FSDP2 sharding over the data dimension when ``strategy: fsdp2``.
    ``pipeline: N`` splits the decoder layers into N stages (``llmpipe/training/pipeline.py``); the world
    is then a (data x pipeline) mesh, each stage FSDP2-sharded over its world / N replicas, and with
    both a (data x pipeline x tensor) mesh (3-D). It is
    a run setting like ``launch``: the same global batch gives the same model at any degree (tested to
    1e-5 against one process), so it stays out of the stage key.
    """

    tensor: int = run_setting(1, gt=0, description="tensor-parallel degree: ranks per model replica "
                              "(1: off); must divide the world size and the attention and KV heads")
    pipeline: int = run_setting(1, gt=0, description="pipeline stages, one per rank, split by decoder "
                                "layer (1: off); pipeline x tensor must divide the world size (the "
                                "rest: data-parallel replicas, strategy fsdp2) and the layers")
    schedule: Literal["1f1b", "gpipe"] = run_setting("1f1b", description="pipeline schedule over the "
                                                     "step's micro-batches")


class LaunchConfig(Section):
    """How the workers start: launcher, device, processes per node, nodes and their rendezvous."""

    device: Literal["auto", "cpu", "cuda"] = run_setting("auto")
    launcher: Literal["torchrun", "deepspeed"] = run_setting("torchrun")
    nproc_per_node: int = run_setting(2, gt=0)
    nodes: int = run_setting(1, gt=0)
    node_rank: int = run_setting(0, ge=0)
    rdzv_endpoint: str | None = run_setting(None, description="host:port of the c10d rendezvous (multi-node)")
    rdzv_id: str | None = run_setting(None, description="job id shared by all nodes (default: the stage key)")
    hostfile: str | None = run_setting(None, description="deepspeed launcher hostfile (multi-node)")
    master_port: int = run_setting(0, ge=0, description="0: pick a free port")
    timeout_s: float = run_setting(3600.0, gt=0)
    threads_per_process: int = run_setting(0, ge=0, description="OMP threads per worker (0: cores / processes)")
    prefetch: int = run_setting(2, ge=0, description="steps of batches a background thread assembles ahead "
                                "(on CUDA copied from pinned memory while the step computes); 0: off")
    deterministic: bool = run_setting(False, description="torch.use_deterministic_algorithms on the GPU: "
                                      "bit-exact reruns at a cost (no Inductor autotuning, NaN-filled new "
                                      "tensors; flash attention's backward stays nondeterministic); the CPU "
                                      "kernels llmpipe runs are deterministic either way")
    peak_tflops: float | None = run_setting(None, gt=0, description="the device's peak dense bf16 TFLOP/s "
                                            "for MFU (None: from the exact device name, "
                                            "llmpipe.training.model.PEAK_FLOPS)")

    @model_validator(mode="after")
    def _topology(self) -> LaunchConfig:
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank must be < nodes ({self.nodes}), got {self.node_rank}")
        if self.nodes > 1 and not (self.rdzv_endpoint or self.hostfile):
            raise ValueError(f"nodes > 1 needs rdzv_endpoint (torchrun) or hostfile (deepspeed launcher), "
                             f"got nodes {self.nodes} and neither")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


class TrainConfig(Section):
    """``train:``: what defines the run as a whole at the top, the rest in its sub-sections."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    seed: int = 1234
    seq_len: int | None = Field(None, gt=1, description="None: the packed sequence length of the tokenize artifact")
    split: str = "train"

    strategy: Literal["auto", "ddp", "fsdp2", "deepspeed"] = Field(
        "ddp", description="auto: chosen from the parameter count and the devices' memory, and logged "
                           "(llmpipe/training/strategy.py)")
    deepspeed: str | dict[str, Any] | None = Field(
        None, description="configs/deepspeed/*.json path or an inline dict (zero_optimization, ...)")

    global_batch_size: int = Field(8, gt=0, description="sequences per optimizer step, all ranks together")
    micro_batch_size: int = Field(2, gt=0, description="sequences per forward pass per rank")
    max_steps: int = Field(20, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    gradient_checkpointing: bool = False
    compile: bool = False
    log_every: int = run_setting(1, gt=0)
    # in the key: the validation figures are results in the artifact's metrics
    eval_every: int = Field(0, ge=0, description="steps between validation passes (loss and bits per byte "
                            "on the first eval_sequences of eval_split, and at the last step); 0: off")
    eval_split: str = Field("val", description="the packed split held out for validation")
    eval_sequences: int = Field(64, gt=0, description="the fixed held-out slice: this many sequences from "
                                "the start of eval_split (rounded down to whole micro-batches per replica)")

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    parallel: ParallelConfig = run_setting(default_factory=ParallelConfig)  # how, not what: out of the key
    loss: LossConfig = Field(default_factory=LossConfig)
    watch: WatchConfig = Field(default_factory=WatchConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    lr_find: LrFindConfig = Field(default_factory=LrFindConfig)

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_is_a_section(cls, v: Any) -> Any:
        """An earlier release took ``schedule: cosine``; say where the kind lives now."""
        if isinstance(v, str):
            raise ValueError(f"is a section now: write schedule: {{kind: {v}}} (train.schedule.kind), got {v!r}")
        return v

    @field_validator("deepspeed")
    @classmethod
    def _ds_shape(cls, v: Any) -> Any:
        if isinstance(v, dict) and "zero_optimization" in v and not isinstance(v["zero_optimization"], dict):
            raise ValueError("zero_optimization must be a mapping, e.g. {stage: 2}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                             f"micro_batch_size ({self.micro_batch_size})")
        if self.schedule.kind == "wsd" and self.wsd_decay_steps > self.max_steps - self.schedule.warmup_steps:
            raise ValueError(f"schedule.decay_steps ({self.wsd_decay_steps}) is longer than the steps after "
                             f"warmup (max_steps {self.max_steps} - schedule.warmup_steps "
                             f"{self.schedule.warmup_steps})")
        if self.launch.launcher == "deepspeed" and self.strategy != "deepspeed":
            raise ValueError(f"launch.launcher 'deepspeed' needs strategy 'deepspeed', got {self.strategy!r}")
        self._check_parallel()
        return self

    def _check_parallel(self) -> None:
        tp, world = self.parallel.tensor, self.launch.world_size
        if self.parallel.pipeline > 1:
            self._check_pipeline()  # with or without tensor parallelism
            return
        if tp == 1:
            return
        if self.strategy == "deepspeed":
            raise ValueError("parallel.tensor > 1 runs under strategy ddp or fsdp2 (PyTorch DTensor), "
                             "not deepspeed")
        if world % tp:
            raise ValueError(f"parallel.tensor ({tp}) must divide the world size (launch.nodes x "
                             f"launch.nproc_per_node = {world})")
        if world > tp and self.strategy == "ddp":
            raise ValueError(f"parallel.tensor ({tp}) on {world} ranks leaves {world // tp} data-parallel "
                             f"replicas: that needs strategy fsdp2 (sharded over the data dimension), got ddp")

    def _check_pipeline(self) -> None:
        pp, tp, world = self.parallel.pipeline, self.parallel.tensor, self.launch.world_size
        per_replica = pp * tp
        ranks = f"parallel.pipeline ({pp}) x parallel.tensor ({tp})" if tp > 1 else f"parallel.pipeline ({pp})"
        if world % per_replica:
            raise ValueError(f"{ranks} must divide the world size (launch.nodes x launch.nproc_per_node "
                             f"= {world})")
        if self.strategy not in ("auto", "ddp", "fsdp2"):
            raise ValueError(f"parallel.pipeline > 1 runs under strategy ddp or fsdp2, got {self.strategy!r}")
        replicas = world // per_replica
        if replicas > 1 and self.strategy == "ddp":
            raise ValueError(f"{ranks} on {world} ranks leaves {replicas} data-parallel replicas: that needs "
                             f"strategy fsdp2 (each stage sharded over its replicas), got ddp")
        if self.global_batch_size % (self.micro_batch_size * replicas):
            raise ValueError(f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                             f"micro_batch_size ({self.micro_batch_size}) x {replicas} data-parallel replicas "
                             f"(world {world} / {per_replica} ranks per replica)")
        micro = self.global_batch_size // (self.micro_batch_size * replicas)
        if self.parallel.schedule == "1f1b" and micro < pp:
            raise ValueError(f"parallel.schedule 1f1b needs at least parallel.pipeline ({pp}) micro-batches "
                             f"per replica and step, got {micro} (global_batch_size {self.global_batch_size} / "
                             f"(micro_batch_size {self.micro_batch_size} x {replicas} replicas))")
        if self.precision == "fp16":
            raise ValueError("parallel.pipeline > 1 has no fp16 loss scaling: use bf16 or fp32")
        if self.eval_every:
            raise ValueError("eval_every with parallel.pipeline > 1: the pipeline schedule runs training steps "
                             "only; set eval_every: 0 (the evaluate stage scores the exported model)")
        if self.compile:
            raise ValueError("compile: true with parallel.pipeline > 1: the pipeline stages run uncompiled "
                             "(torch.distributed.pipelining drives each stage's forward itself); set compile: false")
        if self.loss.entity_weight is not None:
            raise ValueError("parallel.pipeline > 1: the last stage computes plain cross-entropy; "
                             "the entity loss (loss.entity_weight) is not supported there")

    @property
    def wsd_decay_steps(self) -> int:
        """The steps of a ``wsd`` schedule's decay: ``decay_steps``, else ``decay_ratio`` of max_steps."""
        return self.schedule.decay_steps or max(1, round(self.schedule.decay_ratio * self.max_steps))

    @property
    def model_parallel(self) -> int:
        """Ranks per model replica: tensor x pipeline degrees."""
        return self.parallel.tensor * self.parallel.pipeline

    @property
    def data_parallel(self) -> int:
        """Data-parallel replicas: the world over the ranks of one replica."""
        return self.launch.world_size // self.model_parallel
