"""Exact + MinHash LSH near-dedup with a persistent, incremental index (see ``core`` for the rule).

The ``dedup`` stage lives in :mod:`llmpipe.curation.dedup.stage` (imported by ``llmpipe.pipeline``).
"""

from llmpipe.curation.dedup.minhash import permutations, signatures
from llmpipe.curation.dedup.text import exact_hash, normalize, shingles

__all__ = ["exact_hash", "normalize", "permutations", "shingles", "signatures"]
