"""The ``post_train`` flow: Tune the pretrained model on instructions (sft), then on preferences (DPO); evaluate the tuned model."""

from __future__ import annotations

from typing import Any

from flows.common import DEFAULT_CONFIG, llmpipe_flow, run_flow


@llmpipe_flow(name="post_train")
def post_train(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None, from_stage: str | None = None,
       until: str | None = None) -> list[dict[str, Any]]:
    """Tune the pretrained model on instructions (sft), then on preferences (DPO); evaluate the tuned model."""
    return run_flow("post_train", config, overrides, from_stage, until)


if __name__ == "__main__":
    post_train()
