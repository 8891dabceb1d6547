"""Smoke-run helpers: the sample's store, its overrides, and the full-run estimate."""

from __future__ import annotations

import pytest

from llmpipe.config import load_config
from llmpipe.smoke import full_run_estimate, sample_overrides, sample_store


def test_the_sample_has_a_store_of_its_own_and_a_valid_config() -> None:
    assert sample_store(".llmpipe/store/", 0.01) == ".llmpipe/store-sample-0.01"
    assert sample_store("s3://bucket/llmpipe", 0.25) == "s3://bucket/llmpipe-sample-0.25"
    cfg = load_config(None, sample_overrides(".llmpipe/store", 0.01))
    assert cfg.ingest.sample == 0.01 and cfg.store == ".llmpipe/store-sample-0.01"
    for bad in (0.0, 1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="--sample must be a fraction between 0 and 1"):
            sample_overrides(".llmpipe/store", bad)


def test_the_estimate_scales_the_sample_up() -> None:
    stats = {"ingest": {"ingested": 7, "read": 672}, "augment": {"docs_out": 5},
             "tokenize": {"train_tokens": 1000}}
    lines = full_run_estimate(0.01, stats, global_batch=8, seq_len=128, max_steps=400)
    text = "\n".join(lines)
    assert "1.00% of each source" in lines[0]
    assert "documents" in text and "700" in text and "(this run: 7 of 672 read)" in text
    assert "100,000" in text  # train tokens
    assert "steps/epoch" in text and " 98 " in text  # ceil(100000 / (8 * 128))
    assert "train.max_steps is 400: 4.1 epochs" in text
