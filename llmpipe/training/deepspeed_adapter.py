"""The one place llmpipe relies on DeepSpeed internals: skipping the CPU shared-memory all-reduce op.

On CPU, ``deepspeed.comm.torch.TorchBackend.__init__`` calls the module-level ``build_shm_op()``,
which JIT-compiles the ``deepspeed_shm_comm`` C++ op (about 2.5 minutes on 2 cores, on first use).
That op serves DeepSpeed's inference all-reduce; training all-reduces go through torch.distributed
(gloo) either way. DeepSpeed 0.19 has no public switch for it (``DS_BUILD_SHM_COMM`` only applies to
an install-time prebuild), so :func:`skip_shm_comm_build` replaces that function for this process.
``tests/unit/training/test_deepspeed_adapter.py`` pins what this relies on, so a DeepSpeed upgrade
that moves it fails there, with this module named.
"""

from __future__ import annotations

import importlib
from typing import Any

MODULE = "deepspeed.comm.torch"
FUNCTION = "build_shm_op"


def _no_shm_op() -> None:
    """What ``build_shm_op`` returns where the op cannot be built: DeepSpeed then uses torch.distributed."""
    return None


def skip_shm_comm_build() -> None:
    """Make DeepSpeed's CPU backend skip building the shared-memory op (call before ``init_distributed``)."""
    module: Any = importlib.import_module(MODULE)
    if not callable(getattr(module, FUNCTION, None)):
        raise RuntimeError(f"{MODULE}.{FUNCTION} no longer exists in this DeepSpeed: update "
                           "llmpipe/training/deepspeed_adapter.py (the CPU shm op would JIT-compile)")
    setattr(module, FUNCTION, _no_shm_op)
