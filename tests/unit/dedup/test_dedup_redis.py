"""The LSH index in a real Redis (datasketch storage_config), started by the test on a free port."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmpipe.curation.config import DedupConfig, RedisSettings
from llmpipe.ops.process import free_port
from llmpipe.store import ArtifactStore
from tests.unit.dedup.dedup_testlib import publish_input, run_dedup
from tests.unit.dedup.test_dedup_stage import _decisions, _planted_corpus

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server not installed (scripts/install.sh adds it)")


@pytest.fixture
def redis_port(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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
