"""Our vectorized signatures must be bit-identical to datasketch's MinHash (affine32, sha1_hash32)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from datasketch import MinHash, MinHashLSH
from pydantic import ValidationError

from llmpipe.curation.config import DedupConfig
from llmpipe.curation.dedup.lsh import band_keys, lsh_params
from llmpipe.curation.dedup.minhash import (
    HAVE_NUMBA,
    NUMBA_MIN_BYTES,
    _signatures_numpy,
    encode,
    permutations,
    resolve_backend,
    signatures,
)
from llmpipe.curation.dedup.text import normalize, shingles

BACKENDS = ["numpy"] + (["numba"] if HAVE_NUMBA else [])


def _corpus() -> list[str]:
    rng = random.Random(7)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzéß") for _ in range(rng.randint(1, 30)))
             for _ in range(500)]
    texts = ["", "   ", "one", "Hello  WORLD\n\tagain", "a b c d e", "a b c d e f",
             "今天天气很好，我们去公园散步吧。", "東京は日本の首都です", "สวัสดีครับ ยินดีต้อนรับ", "ab",
             "mixed 中文 and english words here ok", "emoji 😀 text with ﬁ ligature ＡＢＣ fullwidth",
             "x" * 200 + " " + "y" * 70,  # shingles longer than one SHA-1 block
             " ".join(["z" * 50] * 9), "\x00\x01 binary junk \uffff"]
    texts += [" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 300))) for _ in range(60)]
    return texts


def _reference(texts: list[str], num_perm: int, seed: int, word_ngram: int = 5, char_ngram: int = 5) -> np.ndarray:
    rows = []
    for t in texts:
        m = MinHash(num_perm=num_perm, seed=seed)
        m.update_batch(shingles(t, word_ngram=word_ngram, char_ngram=char_ngram))
        rows.append(m.hashvalues)
    return np.array(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_perm", "seed", "wn", "cn"), [(128, 1, 5, 5), (64, 42, 3, 2), (256, 7, 1, 1)])
def test_signatures_bit_identical_to_datasketch(backend: str, num_perm: int, seed: int, wn: int, cn: int) -> None:
    texts = _corpus()
    ours = signatures(texts, num_perm=num_perm, seed=seed, word_ngram=wn, char_ngram=cn, backend=backend)
    ref = _reference(texts, num_perm, seed, wn, cn)
    assert ours.dtype == np.uint32 and ref.dtype == np.uint32
    bad = np.flatnonzero((ours != ref).any(axis=1))
    assert not len(bad), f"rows differ from datasketch: {[texts[i][:30] for i in bad[:5]]}"


@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 15])
def test_numpy_chunks_split_documents_without_changing_a_bit(chunk: int) -> None:
    """The numpy path reduces a fixed number of shingles at a time: documents that span chunks (or
    several chunks), empty ones between them, and chunks holding many documents give datasketch's rows."""
    texts = _corpus()
    a, b = permutations(64, 3)
    ours = _signatures_numpy(encode(texts), a, b, 5, 5, chunk_shingles=chunk)
    assert np.array_equal(ours, _reference(texts, 64, 3))


def test_auto_backend_is_decided_for_the_whole_run() -> None:
    """``auto`` takes numba for a run of at least NUMBA_MIN_BYTES of text however it is batched, numpy
    below it; a named backend is kept."""
    assert resolve_backend("auto", NUMBA_MIN_BYTES - 1) == "numpy"
    assert resolve_backend("auto", NUMBA_MIN_BYTES) == ("numba" if HAVE_NUMBA else "numpy")
    assert resolve_backend("numpy", 1 << 40) == "numpy" and resolve_backend("numba", 0) == "numba"


def test_cjk_uses_character_shingles_and_lang_overrides() -> None:
    assert shingles("今天天气很好", char_ngram=2)[:2] == ["今天".encode(), "天天".encode()]
    assert shingles("a b c d e f g", word_ngram=5) == [b"a b c d e", b"b c d e f", b"c d e f g"]
    # lang metadata forces character shingles even for a Latin-script text
    assert shingles("ab cd", char_ngram=2, lang="zh") == [b"ab", b"bc", b"cd"]
    sig_lang = signatures(["ab cd"], char_ngram=2, langs=["zh"])
    m = MinHash(num_perm=128, seed=1)
    m.update_batch([b"ab", b"bc", b"cd"])
    assert (sig_lang[0] == m.hashvalues).all()


def test_normalize_and_empty_signature() -> None:
    assert normalize("  Ｈello\u00a0 WORLD\n") == "hello world"
    empty = signatures(["", "  \n "])
    assert (empty == np.uint32(0xFFFFFFFF)).all()  # like a fresh datasketch MinHash


@pytest.mark.parametrize(("threshold", "num_perm"), [(0.8, 128), (0.5, 64), (0.9, 256)])
def test_lsh_params_match_datasketch(threshold: float, num_perm: int) -> None:
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    assert lsh_params(threshold, num_perm) == (lsh.b, lsh.r)
    assert lsh_params(threshold, num_perm, 16, 8) == (16, 8)


def test_band_keys_collide_exactly_when_bands_equal() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, size=(3, 16), dtype=np.uint32)
    b = a.copy()
    b[1, 5] ^= 1  # changes band 1 (rows 4..7) of row 1 only
    ka, kb = band_keys(a, 4, 4), band_keys(b, 4, 4)
    assert (ka[0] == kb[0]).all() and (ka[2] == kb[2]).all()
    assert ka[1, 1] != kb[1, 1] and (ka[1, [0, 2, 3]] == kb[1, [0, 2, 3]]).all()
    assert len(set(ka[0].tolist())) == 4  # bands are salted: equal values in two bands differ


def test_config_errors_are_clear() -> None:
    with pytest.raises(ValidationError, match=r"must be in \(0, 1\], got 1.5"):
        DedupConfig(threshold=1.5)
    with pytest.raises(ValidationError, match="bands and rows must be given together"):
        DedupConfig(bands=4)
    with pytest.raises(ValidationError, match="exceeds num_perm"):
        DedupConfig(num_perm=64, bands=16, rows=8)
    with pytest.raises(ValidationError, match="Extra inputs"):
        DedupConfig(treshold=0.8)
