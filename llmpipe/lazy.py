"""Import a module on first use, so that planning a DAG never pays for what only a running stage needs."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _LazyModule(types.ModuleType):
    """Stands in for a module until its first attribute is read; then imports it and mirrors it."""

    def __getattr__(self, attr: str) -> Any:
        mod = importlib.import_module(self.__name__)
        # copy the namespace so later reads are plain dict hits (hot loops pay nothing after the first)
        self.__dict__.update({k: v for k, v in vars(mod).items() if k != "__getattr__"})
        return getattr(mod, attr)


def lazy_import(name: str) -> Any:
    """``np = lazy_import("numpy")``: the import happens when the stage first uses ``np``, not on import.

    Every ``llmpipe`` command (``status``, a cached rerun) imports all stage modules to learn the DAG;
    a stage module that imports torch, numba or pyarrow at the top would make each of them pay seconds
    for libraries only a running stage needs. Already imported modules are returned as they are.
    """
    return sys.modules.get(name) or _LazyModule(name)
