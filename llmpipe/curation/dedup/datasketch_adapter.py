"""What the dedup stage assumes about datasketch 2.0 beyond its public calls, in one place.

Everything else in :mod:`llmpipe.curation.dedup` uses datasketch's public API (``MinHashLSH``
and its ``insert`` / ``query`` / ``insertion_session``, ``b`` / ``r`` / ``h`` / ``hashtables`` /
``keys``, the storages' ``insert`` / ``remove`` / ``keys``, pickling). Three things have no public
form (or none fast enough for a whole index), and live here:

- :func:`optimal_params` when datasketch's optimum has fewer than 2 bands: the ``MinHashLSH``
  constructor computes (b, r) itself but then refuses b < 2, which the external backend can use;
  only then does :func:`weighted_error_optimum` search the same grid with the same integrals
  (the LSH S-curve's false-positive area below the threshold and false-negative area above it).
- :func:`bulk_insert`: replaying a delta inserts millions of (band, document) entries; going
  through ``MinHashLSH.insert`` builds a ``LeanMinHash`` and byteswaps every band separately per
  document. We compute the bucket keys for all documents with one numpy byteswap instead, which
  relies on datasketch's bucket key format (a band's hash values, in the ``LeanMinHash`` dtype,
  byteswapped, as bytes) and then store them through the storages' public ``insert``.
- :func:`free`: releasing an index's buckets by reference counting relies on ``hashtables``
  holding the only reference to the bucket tables.

``tests/unit/curation/dedup/test_datasketch_adapter.py`` pins each against public datasketch behaviour, so a
datasketch upgrade that changes one of them fails that one test with a message naming what changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from datasketch import LeanMinHash, MinHashLSH

SCHEME = "affine32"  # the MinHash permutation scheme our signatures reproduce (see minhash.py)


# datasketch's optimum for the default dedup settings (threshold, num_perm, fp_weight, fn_weight),
# written out: finding it takes ~3,000 numerical integrations, ~0.2 CPU-seconds in every dedup
# process. A test computes every entry again with ``MinHashLSH`` and compares.
KNOWN_OPTIMA: dict[tuple[float, int, float, float], tuple[int, int]] = {(0.8, 256, 0.02, 0.98): (28, 9)}


def optimal_params(threshold: float, num_perm: int, fp_weight: float, fn_weight: float) -> tuple[int, int]:
    """datasketch's (bands, rows) minimizing ``fp_weight * P(fp) + fn_weight * P(fn)`` (looked up in
    :data:`KNOWN_OPTIMA` first).

    The public constructor computes it; it raises ``ValueError`` only for an optimum with b < 2 or
    weights whose float sum is not exactly 1.0 (the config allows 1e-9), and for those
    :func:`weighted_error_optimum` (pinned to the constructor's answers by a test) gives it.
    """
    known = KNOWN_OPTIMA.get((threshold, num_perm, fp_weight, fn_weight))
    if known is not None:
        return known
    try:
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(fp_weight, fn_weight))
    except ValueError:
        return weighted_error_optimum(threshold, num_perm, fp_weight, fn_weight)
    return int(lsh.b), int(lsh.r)


def weighted_error_optimum(threshold: float, num_perm: int, fp_weight: float, fn_weight: float
                           ) -> tuple[int, int]:
    """The (bands, rows) with ``b * r <= num_perm`` minimizing ``fp_weight * FP + fn_weight * FN``, where
    a pair of similarity ``s`` collides with probability ``1 - (1 - s**r)**b``: FP is that curve's area
    below ``threshold``, FN the area above it of the miss probability (MinHashLSH's own criterion)."""
    from scipy.integrate import quad

    best, opt = float("inf"), (0, 0)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = quad(lambda s, b=b, r=r: 1 - (1 - s ** float(r)) ** float(b), 0.0, threshold)[0]
            fn = quad(lambda s, b=b, r=r: (1 - s ** float(r)) ** float(b), threshold, 1.0)[0]
            error = fp * fp_weight + fn * fn_weight
            if error < best:
                best, opt = error, (b, r)
    return opt


def lean(row: np.ndarray, seed: int) -> LeanMinHash:
    """A ``LeanMinHash`` holding our signature row (scheme ``affine32``, as datasketch's ``MinHash``)."""
    return LeanMinHash(seed=seed, hashvalues=row, scheme=SCHEME)


def bucket_keys(lsh: MinHashLSH, bands: np.ndarray) -> list[list[bytes]]:
    """Per band, each document's bucket key, as ``MinHashLSH.insert`` computes it.

    ``bands``: (n, >= b * r) signature values. datasketch keys a band by
    ``bytes(hashvalues[start:end].byteswap().data)`` with ``hashvalues`` in the ``LeanMinHash``
    dtype (``hashfunc=None``); here one byteswap covers all documents and bands.
    """
    if lsh.hashfunc is not None:
        raise ValueError("bucket_keys reproduces MinHashLSH without a hashfunc only")
    dtype = lean(np.zeros(lsh.h, np.uint32), 1).hashvalues.dtype
    m, width = len(bands), lsh.r * dtype.itemsize
    swapped = np.ascontiguousarray(bands[:, : lsh.b * lsh.r], dtype=dtype).byteswap().reshape(m, lsh.b, lsh.r)
    out = []
    for band in range(lsh.b):
        buf = np.ascontiguousarray(swapped[:, band]).tobytes()
        out.append([buf[o : o + width] for o in range(0, m * width, width)])
    return out


def bulk_insert(lsh: MinHashLSH, keys: Sequence[int], bands: np.ndarray) -> None:
    """Store in ``lsh``'s dict storage what ``insert(key, minhash, check_duplication=False)`` would.

    The index must already know the scheme (one ``insert`` first) and use unpickled keys (dict
    storage); the caller pauses the GC around it.
    """
    if lsh.prepickle:
        raise ValueError("bulk_insert stores keys as given: it needs a MinHashLSH with prepickle=False")
    per_band = bucket_keys(lsh, bands)
    for hs, table in zip(per_band, lsh.hashtables, strict=True):
        ins = table.insert
        for h, k in zip(hs, keys, strict=True):
            ins(h, k)
    ins = lsh.keys.insert
    for k, *hs in zip(keys, *per_band, strict=True):
        ins(k, *hs)



def free(lsh: MinHashLSH) -> None:
    """Free a dict-storage index's buckets now, by reference counting; ``lsh`` is unusable after.

    ``MinHashLSH`` references itself (its bound bucket-key method), so once dropped its millions
    of sets and bytes would wait for a full cyclic collection (a traversal of the whole heap).
    Emptying each table through its public ``remove`` is a Python loop over every (band, bucket),
    ~3x slower than dropping the tables, so we drop them: ``hashtables`` is the only reference
    datasketch keeps to them (pinned by a test; were it not, they would wait for the GC as before).
    """
    lsh.keys.remove(*lsh.keys.keys())
    lsh.hashtables.clear()
