"""Triton model repository generation: config.pbtxt, model.py, the checkpoint, a version registry.

Layout (Python backend)::

    <repo>/<model>/config.pbtxt
    <repo>/<model>/<version>/model.py                 # llmpipe/serving/triton_model.py
    <repo>/<model>/<version>/llmpipe_serving.json     # request limits read by model.py
    <repo>/<model>/<version>/checkpoint/...           # the quantize artifact's HF checkpoint (hard links)
    <repo>/<model>_stream/...                         # with ``streaming``: the same files, decoupled config

Inputs: a ``prompt`` (UTF-8 bytes) or ``input_ids``, ``max_tokens``, and the sampling: ``temperature``,
``top_k``, ``top_p``, ``seed`` (all optional; Triton batches only requests that send the same set).
The batch model's queue is bounded (``default_queue_policy { max_queue_size: deploy.max_waiting }``).

The streaming model runs the same model.py: its config.pbtxt sets ``model_transaction_policy
{ decoupled: true }``, so it answers each request with one response per generated token (gRPC
streaming, HTTP ``generate_stream``); it has no response cache (Triton caches only one-response models).

With ``backend: vllm`` the version dir holds ``model.json`` for Triton's vLLM backend instead of
model.py (decoupled streaming, ``max_batch_size: 0``: vLLM batches on its own).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llmpipe.files import link_file
from llmpipe.serving.config import STREAM_SUFFIX, DeployConfig
from llmpipe.serving.layout import DEPLOY
from llmpipe.serving.triton_model import CHECKPOINT_DIR, SETTINGS_FILE

TEMPLATE = Path(__file__).with_name("triton_model.py")
REPO_DIR = DEPLOY.repository
# Tensor contract of the Python-backend model (also used by the client and the tests).
INPUTS = (
    ("prompt", "TYPE_UINT8", "[ -1 ]", True),  # UTF-8 bytes (see triton_model.py for why not BYTES)
    ("input_ids", "TYPE_INT64", "[ -1 ]", True),
    ("max_tokens", "TYPE_INT32", "[ 1 ]", True),
    ("temperature", "TYPE_FP32", "[ 1 ]", True),
    ("top_k", "TYPE_INT32", "[ 1 ]", True),  # 0: no cut
    ("top_p", "TYPE_FP32", "[ 1 ]", True),
    ("seed", "TYPE_INT64", "[ 1 ]", True),  # a sampled request's own generator; part of the response cache's key
)
OUTPUTS = (("text", "TYPE_UINT8", "[ -1 ]"), ("output_ids", "TYPE_INT64", "[ -1 ]"))


def render_config(cfg: DeployConfig, streaming: bool = False) -> str:
    """config.pbtxt text for the chosen backend; ``streaming``: the decoupled model beside the batch one."""
    kind = "KIND_GPU" if cfg.target == "gpu" else "KIND_CPU"
    if cfg.backend == "vllm":
        return "\n".join([
            f'name: "{cfg.model_name}"', 'backend: "vllm"', "max_batch_size: 0",
            "model_transaction_policy { decoupled: true }",
            f"instance_group [ {{ count: {cfg.instance_count} kind: KIND_MODEL }} ]", "",
        ])
    model = cfg.stream_model_name if streaming else cfg.model_name
    lines = [f'name: "{model}"', 'backend: "python"', f"max_batch_size: {cfg.max_batch_size}"]
    for name, dtype, dims, optional in INPUTS:
        ragged = " allow_ragged_batch: true" if dims == "[ -1 ]" else ""
        opt = " optional: true" if optional else ""
        lines.append(f'input {{ name: "{name}" data_type: {dtype} dims: {dims}{ragged}{opt} }}')
    for name, dtype, dims in OUTPUTS:
        lines.append(f'output {{ name: "{name}" data_type: {dtype} dims: {dims} }}')
    if cfg.dynamic_batching:
        sizes = ", ".join(str(s) for s in sorted(set(cfg.preferred_batch_sizes)))
        # streams join the running batch between decode steps (in-flight batching in model.py): a
        # batching window would only delay their first token
        delay = 0 if streaming else cfg.max_queue_delay_us
        # a bounded queue: Triton refuses what is over it at once (UNAVAILABLE: "Exceeds maximum queue
        # size"); the streaming model's waiting list is bounded by model.py (llmpipe_serving.json)
        queue_policy = "" if streaming else f" default_queue_policy {{ max_queue_size: {cfg.max_waiting} }}"
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {sizes} ] "
                     f"max_queue_delay_microseconds: {delay}{queue_policy} }}")
    lines.append(f"instance_group [ {{ count: {cfg.instance_count} kind: {kind} }} ]")
    if streaming:
        lines.append("model_transaction_policy { decoupled: true }")
    elif cfg.response_cache:
        lines.append("response_cache { enable: true }")
    return "\n".join(lines) + "\n"


def write_model_repository(checkpoint: Path, repo: Path, cfg: DeployConfig, version: int) -> Path:
    """Write the repository under ``repo``; returns the (batch) model's version directory."""
    if version < 1:
        raise ValueError(f"model version must be >= 1, got {version}")
    vdir = _write_model(checkpoint, repo, cfg, version, streaming=False)
    if cfg.streaming and cfg.backend == "python":  # vLLM's backend streams on its own
        _write_model(checkpoint, repo, cfg, version, streaming=True)
    return vdir


def _write_model(checkpoint: Path, repo: Path, cfg: DeployConfig, version: int, streaming: bool) -> Path:
    model_dir = repo / (cfg.stream_model_name if streaming else cfg.model_name)
    vdir = model_dir / str(version)
    vdir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_config(cfg, streaming))
    for f in sorted(Path(checkpoint).rglob("*")):
        if f.is_file():
            link_file(f, vdir / CHECKPOINT_DIR / f.relative_to(checkpoint))
    if cfg.backend == "vllm":
        model_json = {"model": f"{cfg.container_model_root}/{cfg.model_name}/{version}/{CHECKPOINT_DIR}",
                      "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
                      "max_num_seqs": cfg.max_batch_size, "disable_log_requests": True}
        (vdir / "model.json").write_text(json.dumps(model_json, indent=2) + "\n")
    else:
        shutil.copyfile(TEMPLATE, vdir / "model.py")
        # a cached model needs a seed in every sampled request: the seed is part of the cache's key
        limits = {"max_prompt_tokens": cfg.max_prompt_tokens, "max_tokens_limit": cfg.max_tokens_limit,
                  "default_max_tokens": cfg.default_max_tokens, "max_waiting": cfg.max_waiting,
                  "seeded_sampling": cfg.response_cache and not streaming, "stream_linger_ms": cfg.stream_linger_ms,
                  "prefill_chunk_tokens": cfg.prefill_chunk_tokens}
        (vdir / SETTINGS_FILE).write_text(json.dumps(limits, indent=2) + "\n")
    return vdir


def serving_copy(repo: Path) -> Path:
    """A private copy of a model repository for one server run (the caller removes it afterwards).

    Triton's Python backend writes next to ``model.py`` (``__pycache__``), and a published artifact
    never changes, so a server runs from this copy: its directories are new, its files hard links
    (no bytes copied when the filesystem allows; nothing opens them for writing), so whatever the
    server creates lands in the copy. It sits beside the artifact (``.tmp-serve-*``: the store's gc
    removes one a killed server left), else in the system temporary directory.
    """
    repo = Path(repo)
    beside = repo.parent.parent if repo.name == REPO_DIR else repo.parent
    try:
        dest = Path(tempfile.mkdtemp(prefix=".tmp-serve-", dir=beside))
    except OSError:  # a read-only place: the copy costs bytes there, not the artifact
        dest = Path(tempfile.mkdtemp(prefix="llmpipe-serve-"))
    for f in sorted(repo.rglob("*")):
        if f.is_dir():
            (dest / f.relative_to(repo)).mkdir(parents=True, exist_ok=True)
        elif f.is_file():
            link_file(f, dest / f.relative_to(repo))
    return dest


def model_config_summary(repo: Path) -> dict[str, Any]:
    """Model name, version and options of a generated repository (one batch model, and its
    streaming model when there is one)."""
    models = {p.name: p for p in Path(repo).iterdir() if (p / "config.pbtxt").is_file()}
    streams = [n for n in models if n.endswith(STREAM_SUFFIX) and n[: -len(STREAM_SUFFIX)] in models]
    batch = [n for n in models if n not in streams]
    if len(batch) != 1:
        raise ValueError(f"{repo}: expected one model with config.pbtxt (and its streaming model), "
                         f"found {sorted(models)}")
    model_dir = models[batch[0]]
    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        raise ValueError(f"{model_dir}: no numeric version directory")
    text = (model_dir / "config.pbtxt").read_text()
    stream = streams[0] if streams else None
    return {"model": model_dir.name, "version": versions[-1], "backend": "vllm" if '"vllm"' in text else "python",
            "response_cache": "response_cache" in text, "stream_model": stream}
