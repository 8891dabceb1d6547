"""Exact + MinHash LSH near-dedup with a persistent, incremental index (see ``core`` for the rule).

The ``dedup`` stage lives in :mod:`llmpipe.curation.dedup.stage` (imported by ``llmpipe.pipeline``).
"""

from typing import Any

# Where each public name lives; loaded on first use (PEP 562) so that importing the stage module,
# which every ``llmpipe`` command does, does not compile numba kernels or import numpy.
_EXPORTS = {"exact_hash": "text", "normalize": "text", "shingles": "text", "permutations": "minhash",
            "signatures": "minhash"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
