"""Pins what ``llmpipe.curation.dedup.datasketch_adapter`` assumes about datasketch 2.0.

Each assertion names the datasketch behaviour that changed, so an upgrade that breaks the dedup
stage fails here first, with the fix to make in the adapter.
"""

from __future__ import annotations

import gc
import pickle
import weakref

import numpy as np
import pytest
from datasketch import MinHashLSH

from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dedup import datasketch_adapter as ds
from llmpipe.curation.dedup.lsh import lsh_params


def _sigs(n: int, num_perm: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sigs = rng.integers(0, 2**32, size=(n, num_perm), dtype=np.uint32)
    sigs[n // 2 : n // 2 + 5] = sigs[:5]  # shared buckets: sets with several keys
    sigs[n - 1, :8] = sigs[1, :8]  # shares only the first band with doc 1
    return sigs


def _contents(lsh: MinHashLSH) -> tuple[list[dict], dict]:
    return ([{h: set(t.get(h)) for h in t.keys()} for t in lsh.hashtables],
            {k: list(lsh.keys.get(k)) for k in lsh.keys.keys()})


@pytest.mark.parametrize(("threshold", "num_perm", "fp", "fn"), [(0.8, 128, 0.1, 0.9), (0.5, 64, 0.5, 0.5)])
def test_optimal_params_are_minhashlsh_own(threshold: float, num_perm: int, fp: float, fn: float) -> None:
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(fp, fn))
    assert ds.optimal_params(threshold, num_perm, fp, fn) == (lsh.b, lsh.r)
    assert ds.weighted_error_optimum(threshold, num_perm, fp, fn) == (lsh.b, lsh.r), (
        "MinHashLSH no longer picks the weighted-error optimum: fix optimal_params' fallback for b < 2")


def test_default_config_params_unchanged() -> None:
    # the dedup artifact key holds (bands, rows): a change here re-keys every dedup artifact
    cfg = DedupConfig()
    got = lsh_params(cfg.threshold, cfg.num_perm, None, None, cfg.false_positive_weight, cfg.false_negative_weight)
    assert got == (28, 9), "datasketch's optimum for the default config changed"


@pytest.mark.parametrize("key", sorted(ds.KNOWN_OPTIMA))
def test_known_optima_are_minhashlsh_own(key: tuple[float, int, float, float]) -> None:
    threshold, num_perm, fp, fn = key
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(fp, fn))
    assert ds.KNOWN_OPTIMA[key] == (lsh.b, lsh.r), f"datasketch's optimum for {key} changed: update KNOWN_OPTIMA"


def test_optimal_params_below_two_bands_falls_back() -> None:
    with pytest.raises(ValueError, match="b < 2"):  # if this fails, datasketch accepts b < 2: drop the fallback
        MinHashLSH(threshold=0.99, num_perm=64, weights=(0.1, 0.9))
    assert ds.optimal_params(0.99, 64, 0.1, 0.9) == (1, 52)  # the external backend can use 1 band


@pytest.mark.parametrize("params", [(16, 8), (10, 7)])  # b * r == num_perm, and < num_perm
def test_bucket_keys_are_what_insert_stores(params: tuple[int, int]) -> None:
    sigs = _sigs(40, 128)
    lsh = MinHashLSH(num_perm=128, params=params)
    for k, row in enumerate(sigs):
        lsh.insert(k, ds.lean(row, 1), check_duplication=False)
    per_band = ds.bucket_keys(lsh, sigs)
    got = [[per_band[band][k] for band in range(lsh.b)] for k in range(len(sigs))]
    assert got == [list(lsh.keys.get(k)) for k in range(len(sigs))], (
        "datasketch changed its bucket key format (a band's hash values, byteswapped): fix bucket_keys")


def test_bulk_insert_equals_insert() -> None:
    sigs = _sigs(60, 128)
    ref = MinHashLSH(num_perm=128, params=(16, 8))
    for k, row in enumerate(sigs):
        ref.insert(3 * k, ds.lean(row, 1), check_duplication=False)
    got = pickle.loads(pickle.dumps(MinHashLSH(num_perm=128, params=(16, 8))))  # as the stage loads a base
    got.insert(0, ds.lean(sigs[0], 1), check_duplication=False)  # records the scheme, as the stage does
    ds.bulk_insert(got, [3 * k for k in range(1, len(sigs))], sigs[1:, :128])
    assert _contents(got) == _contents(ref), "datasketch's dict storage no longer holds what bulk_insert stores"
    for k in (0, 30, 59):
        q = ds.lean(sigs[k], 1)
        assert sorted(got.query(q)) == sorted(ref.query(q))
    assert sorted(got.query(ds.lean(sigs[59], 1))) == [3, 93, 177]  # doc 1, its copy 31, itself: one band is enough


def test_bulk_insert_refuses_what_it_cannot_reproduce() -> None:
    sigs = _sigs(20, 128)
    with pytest.raises(ValueError, match="prepickle=False"):
        ds.bulk_insert(MinHashLSH(num_perm=128, params=(16, 8), prepickle=True), [1, 2], sigs[:2])
    with pytest.raises(ValueError, match="hashfunc"):
        ds.bulk_insert(MinHashLSH(num_perm=128, params=(16, 8), hashfunc=lambda b: b), [1, 2], sigs[:2])


def test_free_releases_the_tables_without_the_gc() -> None:
    sigs = _sigs(30, 128)
    lsh = MinHashLSH(num_perm=128, params=(16, 8))
    for k, row in enumerate(sigs):
        lsh.insert(k, ds.lean(row, 1), check_duplication=False)
    refs = [weakref.ref(t) for t in lsh.hashtables]
    enabled = gc.isenabled()
    gc.disable()
    try:
        ds.free(lsh)
        alive = sum(r() is not None for r in refs)
    finally:
        if enabled:
            gc.enable()
    assert alive == 0, "datasketch keeps other references to its bucket tables: free() no longer frees them"
    assert len(lsh.keys) == 0
