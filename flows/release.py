"""The ``release`` flow: Quantize the evaluated model, gate on quality, deploy it to Triton."""

from __future__ import annotations

from typing import Any

from flows.common import DEFAULT_CONFIG, llmpipe_flow, run_flow


@llmpipe_flow(name="release")
def release(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, from_stage: str | None = None,
       until: str | None = None) -> list[dict[str, Any]]:
    """Quantize the evaluated model, gate on quality, deploy it to Triton."""
    return run_flow("release", config, overrides, from_stage, until)


if __name__ == "__main__":
    release()
