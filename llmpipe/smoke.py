"""Smoke runs: the whole DAG on a deterministic fraction of every source, before the full run.

"Run the whole flow on 1% of the data first, then scale up": ``llmpipe run CONFIG --sample 0.01``
sets ``ingest.sample`` (ingest keeps a document when the hash of its id falls below the fraction, so
it is the same 1% on every run and on every machine) and points the run at a store of its own
(``<store>-sample-0.01``), so sampled artifacts never mix with, reuse or overwrite full-size ones.
After the run, :func:`full_run_estimate` scales what the sample measured up to the full data.
"""

from __future__ import annotations

import math
from typing import Any


def sample_store(store: str, fraction: float) -> str:
    """The store of a smoke run: a sibling of the full store, named by the fraction."""
    return f"{store.rstrip('/')}-sample-{fraction:g}"


def check_fraction(fraction: float) -> float:
    if not (0 < fraction < 1) or math.isnan(fraction):
        raise ValueError(f"--sample must be a fraction between 0 and 1 (0.01 = 1%), got {fraction:g}")
    return fraction


def sample_overrides(store: str, fraction: float) -> list[str]:
    """The config overrides of a smoke run on ``fraction`` of each source."""
    check_fraction(fraction)
    return [f"ingest.sample={fraction!r}", f"store={sample_store(store, fraction)}"]


def full_run_estimate(fraction: float, stats: dict[str, dict[str, Any]], global_batch: int,
                      seq_len: int, max_steps: int) -> list[str]:
    """Lines for the terminal: documents, tokens and steps the full run needs, from a smoke run's stats.

    ``stats``: the manifest stats of the smoke run's stages by stage name (the ones it ran).
    """
    lines = [f"smoke run on {fraction:.2%} of each source; the full run needs about:"]
    ingest = stats.get("ingest")
    if ingest:
        lines.append(f"  documents     {ingest['ingested'] / fraction:>14,.0f}  "
                     f"(this run: {ingest['ingested']:,} of {ingest['read']:,} read)")
    augment = stats.get("augment")
    if augment:
        out = augment["docs_out"]
        lines.append(f"  curated docs  {out / fraction:>14,.0f}  (this run: {out:,}, after dedup and augment)")
    tokenize = stats.get("tokenize")
    if tokenize:
        tokens = tokenize["train_tokens"] / fraction
        epoch = math.ceil(tokens / (global_batch * seq_len))
        lines.append(f"  train tokens  {tokens:>14,.0f}  (this run: {tokenize['train_tokens']:,})")
        lines.append(f"  steps/epoch   {epoch:>14,}  at {global_batch} x {seq_len} tokens per step "
                     f"(train.max_steps is {max_steps:,}: {max_steps / epoch:.2g} epochs)")
    return lines
