"""Memory-management helpers for code that builds very many small objects."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored as it was after).

    For code that creates very many long-lived or acyclic containers: imports of large libraries,
    unpickling an LSH index, per-token work on millions of small objects. The collector's repeated
    passes over the growing heap find nothing to free there; reference counting still frees
    everything that is dropped.
    """
    global _GC_PAUSES, _GC_WAS_ENABLED
    with _GC_LOCK:  # threads may pause at once: the first in disables, the last out restores
        if _GC_PAUSES == 0:
            _GC_WAS_ENABLED = gc.isenabled()
            gc.disable()
        _GC_PAUSES += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES -= 1
            if _GC_PAUSES == 0 and _GC_WAS_ENABLED:
                gc.enable()


_GC_LOCK = threading.Lock()
_GC_PAUSES = 0
_GC_WAS_ENABLED = True
