"""Start the training workers with ``torchrun`` or the ``deepspeed`` launcher, stream their logs, report failures.

Single node: ``torchrun --standalone --nproc_per_node N -m llmpipe.training.trainer --config spec.json``.

Multi-node (``train.launch.nodes > 1``): every node runs the *same* stage with the same config except
``train.launch.node_rank``, and each builds its own agent command::

    torchrun --nnodes 2 --node_rank R --nproc_per_node N \\
             --rdzv_backend c10d --rdzv_endpoint HOST0:29400 --rdzv_id <stage key> -m llmpipe.training.trainer ...

Start one Prefect worker per node in a process work pool (``prefect worker start --pool train``),
and submit the pretrain flow once per node with ``train.launch.node_rank=<r>`` (or let a cluster
scheduler such as Slurm start ``llmpipe run CONFIG --from pretrain --until pretrain
train.launch.node_rank=$SLURM_NODEID`` on every node). The agents meet at the c10d rendezvous on
node 0 and the world is nodes x nproc_per_node. All nodes must see the same store path (shared
filesystem or object store cache) so the checkpoints written by every rank land in one place. With
the DeepSpeed launcher, one node starts the others over ssh from ``train.launch.hostfile``
(``deepspeed --hostfile H``), so only node 0 runs the stage.

Tested on one machine as two "nodes" on 127.0.0.1 (``tests/unit/training``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.processes import free_port, spawn, stop_tree
from llmpipe.training.config import LaunchConfig
from llmpipe.training.trainer import FATAL_SUFFIX, METRIC_PREFIX


class TrainingError(RuntimeError):
    """A worker failed, the run timed out, or the config cannot run; the message says which and why."""


@dataclass
class LaunchResult:
    returncode: int
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    seconds: float
    command: list[str]


TRAINER_MODULE = "llmpipe.training.trainer"


def build_command(cfg: LaunchConfig, spec_path: Path, log_dir: Path, rdzv_id: str = "llmpipe",
                  python: str | None = None, module: str = TRAINER_MODULE) -> list[str]:
    """The launcher command line for this node (see the module docstring for multi-node).

    ``module``: what each worker runs with ``python -m``; another module whose ``__main__`` calls
    :func:`llmpipe.training.trainer.run_worker` with a ``Trainer`` subclass runs a customized loop.
    """
    py = python or sys.executable
    worker = ["-m", module, "--config", str(spec_path)]
    if cfg.launcher == "deepspeed":
        cmd = [py, "-m", "deepspeed.launcher.runner"]
        if cfg.hostfile:
            cmd += ["--hostfile", str(cfg.hostfile), "--num_nodes", str(cfg.nodes)]
        else:
            cmd += ["--num_nodes", "1", "--num_gpus", str(cfg.nproc_per_node)]
        cmd += ["--master_port", str(cfg.master_port or free_port()), "--no_local_rank", "--module",
                module, "--config", str(spec_path)]
        return cmd
    cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.nproc_per_node),
           "--log-dir", str(log_dir), "--max-restarts", "0"]
    if cfg.nodes > 1:
        cmd += ["--nnodes", str(cfg.nodes), "--node_rank", str(cfg.node_rank), "--rdzv_backend", "c10d",
                "--rdzv_endpoint", str(cfg.rdzv_endpoint), "--rdzv_id", cfg.rdzv_id or rdzv_id]
    else:
        cmd += ["--nnodes", "1", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", f"127.0.0.1:{cfg.master_port or free_port()}", "--rdzv_id", rdzv_id]
    return cmd + worker


def worker_env(cfg: LaunchConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the workers: threads per process, DeepSpeed on CPU, unbuffered logs."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    threads = cfg.threads_per_process or max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)
    env["OMP_NUM_THREADS"] = str(threads)
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and _cuda_available())
    if not cuda:
        env.setdefault("DS_ACCELERATOR", "cpu")
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "") if cfg.device == "auto" else ""
    elif cfg.deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    # DeepSpeed JIT-compiles C++ ops (shm_comm: ~2.5 min on 2 cores) once; keep them across runs
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "llmpipe" / "torch_extensions"))
    env.update(extra or {})
    return env


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def launch(
    cfg: LaunchConfig,
    spec: dict[str, Any],
    run_dir: Path,
    on_log: Callable[[str], None] | None = None,
    on_metric: Callable[[dict[str, Any]], None] | None = None,
    rdzv_id: str = "llmpipe",
    env: dict[str, str] | None = None,
    module: str = TRAINER_MODULE,
) -> LaunchResult:
    """Write the spec, start the launcher, stream its output, and raise TrainingError on failure/timeout.

    ``cfg`` is ``train.launch`` (how to start the workers); the spec carries the whole ``train:``
    section to them. ``on_log`` gets every line the workers print (the stage passes its logger); ``on_metric`` gets
    each metric record as rank 0 prints it. If a callback raises, the workers are killed and the
    exception propagates (this is how tests kill a run mid-training).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    errors = run_dir / "errors"
    if errors.exists():
        for f in [*errors.glob("*.json"), *errors.glob(f"*{FATAL_SUFFIX}")]:
            f.unlink()
    spec = dict(spec, run_dir=str(run_dir))
    spec_path = run_dir / f"spec-node{cfg.node_rank}.json"
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    log_dir = run_dir / f"torchrun-logs-node{cfg.node_rank}"
    cmd = build_command(cfg, spec_path, log_dir, rdzv_id=rdzv_id, module=module)
    t0 = time.monotonic()
    # spawn: its own session, and the workers end with this process however it ends (SIGKILL too)
    proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                 env=worker_env(cfg, env))
    tail: list[str] = []
    metrics: list[dict[str, Any]] = []
    failure: list[BaseException] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-200]
            rec = _parse_metric(line)
            try:
                if rec is not None:
                    metrics.append(rec)
                    if on_metric is not None:
                        on_metric(rec)
                elif on_log is not None:
                    on_log(line)
            except BaseException as e:  # a callback asked to stop
                failure.append(e)
                _kill(proc)
                return

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        reader.join(5)
        raise TrainingError(f"training timed out after {cfg.timeout_s:.0f}s (train.launch.timeout_s); "
                            f"last output:\n" + "\n".join(tail[-20:])) from None
    except BaseException:
        _kill(proc)
        raise
    reader.join(10)
    if failure:
        raise failure[0]
    if proc.returncode != 0:
        raise TrainingError(describe_failure(run_dir, log_dir, proc.returncode, tail))
    for f in errors.glob(f"*{FATAL_SUFFIX}"):  # no worker died of a signal: the files stayed empty
        if not f.stat().st_size:
            f.unlink()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return LaunchResult(proc.returncode, metrics, summary, time.monotonic() - t0, cmd)


def _parse_metric(line: str) -> dict[str, Any] | None:
    """A metric record, or None for an ordinary log line (another rank's output may share the line)."""
    at = line.find(METRIC_PREFIX)
    if at < 0:
        return None
    try:
        rec, _ = json.JSONDecoder().raw_decode(line[at + len(METRIC_PREFIX):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "step" in rec else None


def _kill(proc: subprocess.Popen[str]) -> None:
    """Stop the launcher and every worker it started (each torchrun worker has a session of its own)."""
    stop_tree(proc, grace=10.0)


def _fatal_signals(errors: Path) -> list[tuple[float, Any, str, str]]:
    """Ranks that died of a fatal signal: (when, rank, faulthandler's first line, the stack of the
    thread that took the signal, innermost call first, and where the whole dump is)."""
    found = []
    for f in errors.glob(f"rank_*{FATAL_SUFFIX}"):
        if not f.stat().st_size:
            continue
        lines = f.read_text(errors="replace").strip().splitlines()
        at = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 1)
        stack = [line for line in lines[at:at + 9] if line.strip()]
        rank = int(f.name[len("rank_"):-len(FATAL_SUFFIX)])
        found.append((f.stat().st_mtime, rank, lines[0], "\n".join([*stack, f"(every thread's stack: {f})"])))
    return found


def describe_failure(run_dir: Path, log_dir: Path, returncode: int, tail: list[str]) -> str:
    """Name the first failed rank and its error: our per-rank error files and fatal-signal dumps, else
    torchrun's error.json."""
    timed = [(e.get("time", 0.0), int(e["rank"]), e["error"], "\n".join(e.get("traceback", "").strip().splitlines()[-3:]))
             for e in (json.loads(f.read_text()) for f in (run_dir / "errors").glob("rank_*.json"))]
    timed += _fatal_signals(run_dir / "errors")
    found = [rec[1:] for rec in sorted(timed, key=lambda r: r[0])]  # root cause first: peers fail after it
    if not found:
        for f in sorted(log_dir.rglob("error.json")):
            try:
                msg = json.loads(f.read_text()).get("message", {})
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(msg, dict):
                rank = msg.get("extraInfo", {}).get("rank", "?") if isinstance(msg.get("extraInfo"), dict) else "?"
                found.append((rank, str(msg.get("message", ""))[:2000], ""))
    if not found:
        return (f"training workers exited with code {returncode} and left no error file (killed? out of "
                f"memory?); last output:\n" + "\n".join(tail[-30:]))
    first = found[0]
    others = ", ".join(str(r) for r, _, _ in found[1:])
    msg = f"training worker rank {first[0]} failed: {first[1]}"
    if others:
        msg += f" (ranks {others} failed too)"
    if first[2]:
        msg += "\n" + first[2]
    return msg
