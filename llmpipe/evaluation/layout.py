"""The declared layout of a ``evaluate`` artifact: the names other stages, the server and the tests join.

A module of its own (no imports of ours), so a consumer reads the declaration without importing
the stage and its dependencies, and no import cycle can form through it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvaluateLayout:
    """The files of an evaluate artifact that other stages read (the quantize gate reads ``results``)."""

    results: str = "results.json"  # metrics, data, settings, model size, unigram baseline


EVALUATE = EvaluateLayout()
