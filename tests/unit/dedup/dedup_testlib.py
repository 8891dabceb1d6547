"""Helpers for the dedup tests (imported by name: the tests folder has no package): real shards, a real ArtifactStore, the real stage function."""

from __future__ import annotations

import random
import time

from llmpipe.curation.config import DedupConfig
from llmpipe.document import Document, write_shard
from llmpipe.stage import STAGES, LocalRunner, StageContext
from llmpipe.store import Artifact, ArtifactStore, hash_json


def publish_input(store: ArtifactStore, shards: dict[str, list[Document]]) -> Artifact:
    """A 'safety' artifact holding the given shards (the dedup stage's input)."""
    key = hash_json(["safety-test", {n: [d.id for d in docs] for n, docs in shards.items()},
                     {n: [d.text for d in docs] for n, docs in shards.items()}])
    tmp = store.new_tmp_dir("safety", key)
    for name, docs in shards.items():
        write_shard(tmp / "shards" / name, docs)
    return store.publish("safety", key, tmp, version="test", config={}, inputs={}, stats={}, started=time.time())


def run_dedup(store: ArtifactStore, inp: Artifact, cfg: DedupConfig, workers: int = 1) -> Artifact:
    """Run the registered dedup stage the way the runner does, and publish its artifact."""
    import llmpipe.curation.dedup.stage  # noqa: F401  (registers the stage)

    spec = STAGES["dedup"]
    key = hash_json(["dedup", spec.version, cfg.key_dict(), inp.key])
    tmp = store.new_tmp_dir("dedup", key)
    ctx = StageContext(spec=spec, config=cfg, pipeline=None, key=key, out=tmp, inputs={"safety": inp.path},
                       input_keys={"safety": inp.key}, store=store, runner=LocalRunner(workers))
    t0 = time.time()
    stats = spec.fn(ctx)
    return store.publish("dedup", key, tmp, version=spec.version, config=cfg.key_dict(),
                         inputs={"safety": inp.key}, stats=stats, started=t0)


def words(rng: random.Random, n: int, vocab_size: int = 50_000) -> list[str]:
    return [f"w{rng.randrange(vocab_size)}" for _ in range(n)]


def planted_pair(rng: random.Random, n_words: int, edits: int) -> tuple[str, str]:
    """A document and a copy with ``edits`` words replaced, spaced >= 5 apart (5 shingles each)."""
    base = words(rng, n_words)
    copy = list(base)
    slots = list(range(2, n_words - 2, 6))
    for pos in rng.sample(slots, min(edits, len(slots))):
        copy[pos] = f"x{rng.randrange(10**9)}"
    return " ".join(base), " ".join(copy)
