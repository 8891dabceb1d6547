"""``llmpipe run CONFIG --sample 0.01``: the whole tiny DAG on the same 1% every time, in its own store.

As a user runs it, in a fresh folder holding a copy of the tiny config: a full-size ingest first, then
the smoke run (every stage, a short training run, through the session's Prefect server: a run without
one is tests/e2e/test_lifecycle.py's), then the sample's ingest once more into another store. The smoke run finishes, prints what the full run needs, never reads, reuses or writes
the full-size store, and both sample runs hold exactly the same documents, about 1% of the full ones.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.e2e.test_lifecycle import STAGES, _cli, _latest_logs, _table

pytestmark = pytest.mark.slow
# a short training run: every stage still runs, and nothing checked here depends on how long the model trains
SHORT = ["train.max_steps=20", "train.schedule.warmup_steps=2", "train.checkpoint.every=10"]


def _ids(store: Path) -> list[str]:
    import pyarrow.parquet as pq

    (art,) = [p for p in (store / "ingest").iterdir() if (p / "manifest.json").is_file()]
    return sorted(i for f in sorted((art / "shards").glob("*.parquet")) for i in pq.read_table(f)["id"].to_pylist())


def _files(store: Path) -> dict[str, str]:
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and "_shards" not in p.parts}


def test_a_smoke_run_takes_the_same_sample_in_a_store_of_its_own(tmp_path: Path, prefect_api: str) -> None:
    project = tmp_path / "project"
    full = _cli(project, "--until", "ingest", "--no-prefect")
    assert full.returncode == 0, full.stderr[-3000:]
    full_store = project / ".llmpipe" / "store"
    before = _files(full_store)

    smoke = _cli(project, "--sample", "0.01", *SHORT, api_url=prefect_api)
    assert smoke.returncode == 0, smoke.stderr[-3000:] + _latest_logs(project)
    assert list(_table(smoke.stdout)) == STAGES, smoke.stdout
    assert "smoke run on 1.00% of each source; the full run needs about:" in smoke.stdout, smoke.stdout
    for what in ("documents", "train tokens", "steps/epoch"):
        assert what in smoke.stdout, smoke.stdout
    assert _files(full_store) == before, "the smoke run touched the full-size store"
    assert sorted(p.name for p in full_store.iterdir() if not p.name.startswith(("_", "."))) == ["ingest"]

    again = _cli(project, "--sample", "0.01", "--until", "ingest", "--no-prefect", "store=other")
    assert again.returncode == 0, again.stderr[-3000:]
    sample, sample_again = _ids(project / ".llmpipe" / "store-sample-0.01"), _ids(project / "other-sample-0.01")
    assert sample == sample_again and sample, "two smoke runs took different samples"
    everything = set(_ids(full_store))
    assert set(sample) < everything and len(sample) <= 0.03 * len(everything), (len(sample), len(everything))
