"""The dedup stage's write step stays bounded as the corpus grows: the id columns it reads to name
each removed document's keeper, and the shards whose decisions the driver holds at once."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dedup.stage import WRITE_WINDOW
from llmpipe.document import Document, iter_documents, rejected_paths
from llmpipe.executor import LocalExecutor
from tests.fixtures.dedup_runs import publish_input, run_dedup, words


def test_keeper_ids_read_each_shard_once_per_output_shard(store) -> None:
    """Exact copies cycling through 12 earlier shards: a first-in-first-out cache of 8 id columns
    read a keeper's shard again for every copy (36 reads per output shard, 144 in all); each output
    shard now reads each keeper shard once (12 per output shard)."""
    rng = random.Random(7)
    n_src, per_shard, n_out, copies = 12, 20, 4, 36
    files: dict[str, list[Document]] = {}
    texts: list[list[str]] = []
    for s in range(n_src):
        docs = [Document(f"d{s}-{r}", " ".join(words(rng, 60)), "t", {}) for r in range(per_shard)]
        texts.append([d.text for d in docs])
        files[f"part-{s:03d}.parquet"] = docs
    expected: dict[str, str] = {}
    for o in range(n_out):
        docs = []
        for c in range(copies):
            src, row = c % n_src, rng.randrange(per_shard)
            docs.append(Document(f"copy{o}-{c}", texts[src][row], "t", {}))
            expected[f"copy{o}-{c}"] = f"d{src}-{row}"  # a repeated copy too: its target is the original
        files[f"part-{n_src + o:03d}.parquet"] = docs
    art = run_dedup(store, publish_input(store, files), DedupConfig(incremental=False, near=False))
    got = {d.id: d.metadata["duplicate_of"] for p in rejected_paths(art.path) for d in iter_documents(p)}
    assert got == expected  # every copy names the original (the copies' own repeats too)
    assert art.stats["rejected_exact_duplicate"] == n_out * copies
    print("id shard reads", art.stats["id_shard_reads"])
    assert art.stats["id_shard_reads"] <= n_out * n_src, art.stats["id_shard_reads"]


class RecordingExecutor(LocalExecutor):
    """A local executor that records each map call's function and item count."""

    def __init__(self) -> None:
        super().__init__(1)
        self.calls: list[tuple[str, int]] = []

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any],
            on_done: Callable[[int], None] | None = None, threads: bool = False) -> list[Any]:
        self.calls.append((fn.__name__, len(items)))
        return super().map(fn, items, on_done, threads)


def test_decisions_are_written_a_window_of_shards_at_a_time(store) -> None:
    """The driver builds one window of shards' decisions (status and keeper id per row), writes
    them, then the next: what it holds follows WRITE_WINDOW, not the number of shards."""
    rng = random.Random(3)
    n_shards = 2 * WRITE_WINDOW + 3
    files = {f"part-{s:03d}.parquet": [Document(f"d{s}-{r}", " ".join(words(rng, 40)), "t", {}) for r in range(3)]
             for s in range(n_shards)}
    files[f"part-{n_shards:03d}.parquet"] = [Document("copy", files["part-000.parquet"][0].text, "t", {})]
    executor = RecordingExecutor()
    art = run_dedup(store, publish_input(store, files), DedupConfig(incremental=False), executor=executor)
    writes = [n for name, n in executor.calls if name == "write_filtered"]
    assert sum(writes) == n_shards + 1 and max(writes) <= WRITE_WINDOW, executor.calls
    assert art.stats["rejected_exact_duplicate"] == 1 and art.stats["kept"] == 3 * n_shards
