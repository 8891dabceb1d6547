"""The ``pretrain`` flow: Train the model on the packed tokens and evaluate it."""

from __future__ import annotations

from typing import Any

from flows.common import DEFAULT_CONFIG, llmpipe_flow, run_flow


@llmpipe_flow(name="pretrain")
def pretrain(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, from_stage: str | None = None,
       until: str | None = None) -> list[dict[str, Any]]:
    """Train the model on the packed tokens and evaluate it."""
    return run_flow("pretrain", config, overrides, from_stage, until)


if __name__ == "__main__":
    pretrain()
