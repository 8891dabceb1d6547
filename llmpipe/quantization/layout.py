"""The declared layout of a ``quantize`` artifact: the names other stages, the server and the tests join.

A module of its own (no imports of ours), so a consumer reads the declaration without importing
the stage and its dependencies, and no import cycle can form through it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantizeLayout:
    """The files of a quantize artifact that other stages read (deploy serves ``checkpoint``)."""

    checkpoint: str = "model"  # the checkpoint to deploy (compressed-tensors for AWQ; fp + marker for int8)
    calibration: str = "calibration.npy"  # the calibration sample (int64 [n, len], padding = -1)
    results: str = "results.json"  # the gate verdict, fp vs quantized metrics, bytes on disk


QUANTIZE = QuantizeLayout()
