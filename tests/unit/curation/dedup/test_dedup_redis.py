"""The LSH index in a real Redis (datasketch storage_config), started by the test on a free port."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmpipe.curation.config import DedupConfig, RedisSettings
from llmpipe.processes import redis_server
from llmpipe.store import ArtifactStore
from tests.fixtures.dedup_runs import publish_input, run_dedup
from tests.unit.curation.dedup.test_dedup_stage import _decisions, _planted_corpus

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (scripts/install.sh adds it)")


@pytest.fixture
def redis_port(tmp_path: Path) -> Iterator[int]:
    with redis_server(tmp_path) as (port, _proc):
        yield port


def test_redis_index_matches_memory_and_refreshes(tmp_path: Path, redis_port: int) -> None:
    import redis

    shards, _ = _planted_corpus(seed=21, pairs=60)
    first_part = {k: v for k, v in shards.items() if k != "part-002.parquet"}
    rcfg = DedupConfig(backend="redis", redis=RedisSettings(port=redis_port, prefix="t"))
    store = ArtifactStore(tmp_path / "redis-store")
    run_dedup(store, publish_input(store, first_part), rcfg)
    keys_after_first = redis.Redis(port=redis_port).dbsize()
    assert keys_after_first > 0  # the buckets really live in Redis
    inc = run_dedup(store, publish_input(store, shards), rcfg)
    new_unique = len(shards["part-002.parquet"]) - inc.stats.get("rejected_exact_duplicate", 0)
    assert inc.stats["shards_reused"] == 2 and inc.stats["lsh_inserts"] == new_unique
    mem_store = ArtifactStore(tmp_path / "mem-store")
    mem = run_dedup(mem_store, publish_input(mem_store, shards), DedupConfig())
    assert _decisions(inc.path) == _decisions(mem.path)
    assert inc.stats["rejected_near_duplicate"] > 10
