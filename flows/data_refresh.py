"""The ``data_refresh`` flow: Ingest and curate the sources, train the tokenizer, pack tokens (the nightly refresh)."""

from __future__ import annotations

from typing import Any

from flows.common import DEFAULT_CONFIG, llmpipe_flow, run_flow


@llmpipe_flow(name="data-refresh")
def data_refresh(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, from_stage: str | None = None,
       until: str | None = None) -> list[dict[str, Any]]:
    """Ingest and curate the sources, train the tokenizer, pack tokens (the nightly refresh)."""
    return run_flow("data_refresh", config, overrides, from_stage, until)


if __name__ == "__main__":
    data_refresh()
