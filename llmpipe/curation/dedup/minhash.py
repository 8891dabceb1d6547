"""Vectorized MinHash signatures, bit-identical to ``datasketch.MinHash`` (scheme ``affine32``).

datasketch 2.0 hashes every shingle with ``sha1_hash32`` (the first 4 bytes of SHA-1, little
endian), pre-mixes it with the 32-bit MurmurHash3 finalizer, and applies ``num_perm`` affine
permutations ``a * h + b mod 2^32`` whose parameters come from ``np.random.RandomState(seed)``;
the signature is the column-wise minimum. We reproduce each step exactly, but for a whole batch
of documents at once:

- ``numba`` kernel (default when numba imports): SHA-1, fmix and the min-reduction fused in one
  compiled loop over the shingle byte slices, no Python object per shingle;
- numpy fallback: ``hashlib`` per shingle, then fmix / permutation / ``np.minimum.reduceat`` over
  the batch in bounded chunks.

Both are checked against datasketch by ``tests/unit/curation/dedup/test_dedup_minhash.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from llmpipe.curation.dedup.text import normalize, shingle_buffer, use_char_shingles

try:  # optional accelerator; the numpy path gives the same bits
    import numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None
    HAVE_NUMBA = False

EMPTY = np.uint32(0xFFFFFFFF)  # datasketch's initial (and "empty set") hash value


@lru_cache(maxsize=16)
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The affine32 permutation parameters, drawn exactly as ``MinHash._init_permutations``."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (wrapping uint32 arithmetic), as datasketch's ``_fmix``."""
    h = h.astype(np.uint32, copy=True)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


class Encoded:
    """A batch of documents as one byte buffer + offsets + per-document shingle mode."""

    def __init__(self, buf: np.ndarray, offsets: np.ndarray, char_mode: np.ndarray) -> None:
        self.buf, self.offsets, self.char_mode = buf, offsets, char_mode

    def __len__(self) -> int:
        return len(self.offsets) - 1


def encode(texts: Sequence[str], langs: Sequence[str | None] | None = None, *,
           char_ratio: float = 0.3, normalized: bool = False) -> Encoded:
    """Normalize texts and pack their shingle buffers (see :mod:`llmpipe.curation.dedup.text`)."""
    parts: list[bytes] = []
    modes = np.zeros(len(texts), dtype=np.uint8)
    for i, t in enumerate(texts):
        norm = t if normalized else normalize(t)
        cm = use_char_shingles(norm, langs[i] if langs is not None else None, char_ratio)
        modes[i] = cm
        parts.append(shingle_buffer(norm, cm))
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    buf = np.frombuffer(b"".join(parts), dtype=np.uint8) if parts else np.zeros(0, np.uint8)
    return Encoded(buf, offsets, modes)


def signatures(texts: Sequence[str], *, num_perm: int = 128, seed: int = 1, word_ngram: int = 5,
               char_ngram: int = 5, langs: Sequence[str | None] | None = None, char_ratio: float = 0.3,
               backend: str = "auto") -> np.ndarray:
    """MinHash signatures (``len(texts) x num_perm`` uint32) of the texts' shingle sets.

    Row ``i`` equals ``datasketch.MinHash(num_perm, seed).update_batch(shingles(texts[i]))``'s
    ``hashvalues``. ``backend``: ``"numba"``, ``"numpy"`` or ``"auto"`` (numba when installed).
    """
    enc = encode(texts, langs, char_ratio=char_ratio)
    return signatures_encoded(enc, num_perm=num_perm, seed=seed, word_ngram=word_ngram,
                              char_ngram=char_ngram, backend=backend)


def signatures_encoded(enc: Encoded, *, num_perm: int, seed: int, word_ngram: int, char_ngram: int,
                       backend: str = "auto") -> np.ndarray:
    if word_ngram < 1 or char_ngram < 1:
        raise ValueError(f"shingle sizes must be >= 1, got word_ngram={word_ngram} char_ngram={char_ngram}")
    a, b = permutations(num_perm, seed)
    if backend == "auto":
        backend = "numba" if HAVE_NUMBA else "numpy"
    if backend == "numba":
        if not HAVE_NUMBA:
            raise RuntimeError("MinHash backend 'numba' requested but numba is not installed")
        out = np.empty((len(enc), num_perm), dtype=np.uint32)
        _kernel()(enc.buf, enc.offsets, enc.char_mode, word_ngram, char_ngram, a, b, out)
        return out
    if backend != "numpy":
        raise ValueError(f"MinHash backend must be 'auto', 'numba' or 'numpy', got {backend!r}")
    return _signatures_numpy(enc, a, b, word_ngram, char_ngram)


# -- numpy + hashlib path ---------------------------------------------------------------------------

def _shingle_spans(buf: bytes, char_mode: bool, n: int) -> tuple[list[int], list[int]]:
    """(starts, ends) of the shingle slices of one document buffer."""
    if not buf:
        return [], []
    if char_mode:
        arr = np.frombuffer(buf, dtype=np.uint8)
        ustart = np.flatnonzero((arr & 0xC0) != 0x80)
        uend = np.append(ustart[1:], len(buf))
    else:
        spaces = np.flatnonzero(np.frombuffer(buf, dtype=np.uint8) == 0x20)
        ustart = np.concatenate(([0], spaces + 1))
        uend = np.append(spaces, len(buf))
    units = len(ustart)
    if units <= n:
        return [0], [len(buf)]
    return ustart[: units - n + 1].tolist(), uend[n - 1 :].tolist()


def shingle_hashes(enc: Encoded, word_ngram: int, char_ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """sha1_hash32 of every shingle of every document, and per-document offsets into that array."""
    raw = enc.buf.tobytes()
    digests: list[bytes] = []
    counts = np.zeros(len(enc), dtype=np.int64)
    sha1 = hashlib.sha1
    for d in range(len(enc)):
        lo, hi = int(enc.offsets[d]), int(enc.offsets[d + 1])
        doc = raw[lo:hi]
        starts, ends = _shingle_spans(doc, bool(enc.char_mode[d]), char_ngram if enc.char_mode[d] else word_ngram)
        digests.extend(sha1(doc[s:e]).digest() for s, e in zip(starts, ends, strict=True))
        counts[d] = len(starts)
    hashes = np.frombuffer(b"".join(digests), dtype="<u4")[::5].astype(np.uint32) if digests else \
        np.zeros(0, np.uint32)
    offsets = np.zeros(len(enc) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return hashes, offsets


def _signatures_numpy(enc: Encoded, a: np.ndarray, b: np.ndarray, word_ngram: int, char_ngram: int,
                      chunk_shingles: int = 1 << 15) -> np.ndarray:
    hashes, offsets = shingle_hashes(enc, word_ngram, char_ngram)
    mixed = fmix32(hashes)
    out = np.full((len(enc), len(a)), EMPTY, dtype=np.uint32)
    d = 0
    n_docs = len(enc)
    while d < n_docs:  # group whole documents into chunks of about ``chunk_shingles`` shingles
        e = int(np.searchsorted(offsets, offsets[d] + chunk_shingles, side="right")) - 1
        e = min(max(e, d + 1), n_docs)
        lo, hi = int(offsets[d]), int(offsets[e])
        if hi > lo:
            phv = mixed[lo:hi, None] * a[None, :] + b[None, :]
            nonempty = np.flatnonzero(offsets[d + 1 : e + 1] > offsets[d:e]) + d
            out[nonempty] = np.minimum.reduceat(phv, offsets[nonempty] - lo, axis=0)
        d = e
    return out


# -- numba path -------------------------------------------------------------------------------------

def _kernel():
    return _minhash_kernel


def _njit(*args, **kwargs):
    """``numba.njit`` when numba is installed, else leave the function as plain Python (unused)."""
    if HAVE_NUMBA:
        return numba.njit(*args, **kwargs)
    return lambda fn: fn


u64 = np.uint64
mask = u64(0xFFFFFFFF)


@_njit(cache=True, inline="always")
def rotl(x, n):
    return ((x << u64(n)) | (x >> u64(32 - n))) & mask

@_njit(cache=True, inline="always")
def _load_words(src, base, w):
    for t in range(16):
        p = base + 4 * t
        w[t] = (u64(src[p]) << u64(24)) | (u64(src[p + 1]) << u64(16)) | (u64(src[p + 2]) << u64(8)) | \
            u64(src[p + 3])


@_njit(cache=True, inline="always")
def _compress(w, h):
    for t in range(16, 80):
        w[t] = rotl(w[t - 3] ^ w[t - 8] ^ w[t - 14] ^ w[t - 16], 1)
    a, b, c, d, e = h[0], h[1], h[2], h[3], h[4]
    for t in range(20):
        tmp = (rotl(a, 5) + ((b & c) | ((~b & mask) & d)) + e + u64(0x5A827999) + w[t]) & mask
        e, d, c, b, a = d, c, rotl(b, 30), a, tmp
    for t in range(20, 40):
        tmp = (rotl(a, 5) + (b ^ c ^ d) + e + u64(0x6ED9EBA1) + w[t]) & mask
        e, d, c, b, a = d, c, rotl(b, 30), a, tmp
    for t in range(40, 60):
        tmp = (rotl(a, 5) + ((b & c) | (b & d) | (c & d)) + e + u64(0x8F1BBCDC) + w[t]) & mask
        e, d, c, b, a = d, c, rotl(b, 30), a, tmp
    for t in range(60, 80):
        tmp = (rotl(a, 5) + (b ^ c ^ d) + e + u64(0xCA62C1D6) + w[t]) & mask
        e, d, c, b, a = d, c, rotl(b, 30), a, tmp
    h[0] = (h[0] + a) & mask
    h[1] = (h[1] + b) & mask
    h[2] = (h[2] + c) & mask
    h[3] = (h[3] + d) & mask
    h[4] = (h[4] + e) & mask


@_njit(cache=True)
def sha1_32(buf, s, e, w, h, tail):
    """First 4 bytes of SHA-1(buf[s:e]) read little-endian (datasketch's sha1_hash32)."""
    length = e - s
    h[0], h[1], h[2], h[3], h[4] = u64(0x67452301), u64(0xEFCDAB89), u64(0x98BADCFE), u64(0x10325476), \
        u64(0xC3D2E1F0)
    full = length // 64
    for blk in range(full):
        _load_words(buf, s + 64 * blk, w)
        _compress(w, h)
    rest = length - 64 * full
    n_tail = 64 if rest < 56 else 128
    for k in range(n_tail):
        tail[k] = 0
    for k in range(rest):
        tail[k] = buf[s + 64 * full + k]
    tail[rest] = 0x80
    bits = u64(length) * u64(8)
    for k in range(8):
        tail[n_tail - 1 - k] = (bits >> u64(8 * k)) & u64(0xFF)
    for base in range(0, n_tail, 64):
        _load_words(tail, base, w)
        _compress(w, h)
    h0 = h[0]
    # digest bytes 0..3 are h0 big-endian; "<I" reads them little-endian: a byte swap
    return ((h0 & u64(0xFF)) << u64(24)) | ((h0 & u64(0xFF00)) << u64(8)) | \
        ((h0 >> u64(8)) & u64(0xFF00)) | (h0 >> u64(24))


@_njit(cache=True, inline="always")
def fmix(h):
    h ^= h >> u64(16)
    h = (h * u64(0x85EBCA6B)) & mask
    h ^= h >> u64(13)
    h = (h * u64(0xC2B2AE35)) & mask
    h ^= h >> u64(16)
    return h

@_njit(cache=True)
def _minhash_kernel(buf, offsets, char_mode, word_n, char_n, a, b, out):
    n_docs = len(offsets) - 1
    num_perm = len(a)
    max_len = 0
    for d in range(n_docs):
        max_len = max(max_len, offsets[d + 1] - offsets[d])
    ustart = np.empty(max_len + 1, np.int64)
    uend = np.empty(max_len + 1, np.int64)
    w = np.empty(80, np.uint64)
    hstate = np.empty(5, np.uint64)
    tail = np.empty(128, np.uint8)
    hs = np.empty(max_len + 1, np.uint32)
    sig = np.empty(num_perm, np.uint64)
    for d in range(n_docs):
        s0, e0 = offsets[d], offsets[d + 1]
        for k in range(num_perm):
            sig[k] = mask
        units = 0
        if e0 > s0:
            if char_mode[d]:
                n = char_n
                for p in range(s0, e0):
                    if (buf[p] & 0xC0) != 0x80:
                        if units > 0:
                            uend[units - 1] = p
                        ustart[units] = p
                        units += 1
                uend[units - 1] = e0
            else:
                n = word_n
                ustart[0] = s0
                units = 1
                for p in range(s0, e0):
                    if buf[p] == 0x20:
                        uend[units - 1] = p
                        ustart[units] = p + 1
                        units += 1
                uend[units - 1] = e0
        if units > 0:
            n_sh = 1 if units <= n else units - n + 1
            for i in range(n_sh):
                if units <= n:
                    ss, se = s0, e0
                else:
                    ss, se = ustart[i], uend[i + n - 1]
                hs[i] = np.uint32(fmix(sha1_32(buf, ss, se, w, hstate, tail)))
            for k in range(num_perm):
                ak, bk = a[k], b[k]
                m = np.uint32(0xFFFFFFFF)
                for i in range(n_sh):
                    v = np.uint32(ak * hs[i] + bk)
                    m = min(m, v)
                sig[k] = m
        for k in range(num_perm):
            out[d, k] = sig[k]
