"""The declared layout of a ``deploy`` artifact: the names other stages, the server and the tests join.

A module of its own (no imports of ours), so a consumer reads the declaration without importing
the stage and its dependencies, and no import cycle can form through it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeployLayout:
    """The files of a deploy artifact that the server, the production manifests and the tests read."""

    repository: str = "model_repository"  # the Triton model repository (see llmpipe/serving/repository.py)
    info: str = "deploy.json"  # model, version, backend, ports
    env: str = "triton.env"  # MODEL_NAME / MODEL_VERSION for docker compose


DEPLOY = DeployLayout()
