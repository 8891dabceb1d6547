"""The ``lifecycle`` flow: Every stage, raw text to a served model."""

from __future__ import annotations

from typing import Any

from flows.common import DEFAULT_CONFIG, llmpipe_flow, run_flow


@llmpipe_flow(name="lifecycle")
def lifecycle(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, from_stage: str | None = None,
       until: str | None = None) -> list[dict[str, Any]]:
    """Every stage, raw text to a served model."""
    return run_flow("lifecycle", config, overrides, from_stage, until)


if __name__ == "__main__":
    lifecycle()
