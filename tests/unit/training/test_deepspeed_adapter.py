"""Pins what ``llmpipe/training/deepspeed_adapter.py`` relies on in DeepSpeed 0.19.

If one of these fails after a DeepSpeed upgrade, the adapter (the only place that reaches into
``deepspeed.comm.torch``) needs updating: without it a CPU DeepSpeed run JIT-compiles the
shared-memory op for minutes on its first start.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from llmpipe.processes import free_port
from tests.conftest import ROOT

deepspeed_comm_torch = pytest.importorskip("deepspeed.comm.torch")


def test_the_cpu_backend_builds_the_op_through_the_module_function() -> None:
    import importlib

    module = importlib.import_module("deepspeed.comm.torch")
    assert callable(getattr(module, "build_shm_op", None)), "deepspeed.comm.torch.build_shm_op is gone"
    init = inspect.getsource(module.TorchBackend.__init__)
    assert "self.shm_comm_op = build_shm_op()" in init, (
        "TorchBackend.__init__ no longer calls the module-level build_shm_op(): the adapter's switch "
        "would not reach it")


def test_skipped_build_leaves_deepspeed_on_torch_distributed_and_compiles_nothing(tmp_path) -> None:  # noqa: ANN001
    """A real one-process gloo ``deepspeed.init_distributed`` after the adapter: no shm op, no build."""
    script = (
        "import importlib, deepspeed\n"
        "from llmpipe.training.deepspeed_adapter import skip_shm_comm_build\n"
        "skip_shm_comm_build()\n"
        "deepspeed.init_distributed(dist_backend='gloo')\n"
        "backend = importlib.import_module('deepspeed.comm.comm').cdb\n"
        "assert type(backend).__name__ == 'TorchBackend' and backend.shm_comm_op is None, backend\n"
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(3); dist.all_reduce(t); assert t.tolist() == [1.0, 1.0, 1.0]\n"
        "print('shm op skipped')\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "shm op skipped" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir()), "an op was compiled"
