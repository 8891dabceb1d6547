"""Vectorized MinHash signatures, bit-identical to ``datasketch.MinHash`` (scheme ``affine32``).

datasketch 2.0 hashes every shingle with ``sha1_hash32`` (the first 4 bytes of SHA-1, little
endian), pre-mixes it with the 32-bit MurmurHash3 finalizer, and applies ``num_perm`` affine
permutations ``a * h + b mod 2^32`` whose parameters come from ``np.random.RandomState(seed)``;
the signature is the column-wise minimum. We reproduce each step exactly, but for a whole batch
of documents at once:

- ``numba`` kernel (:mod:`~llmpipe.curation.dedup.minhash_numba`; ``auto`` takes it when numba is
  installed and a batch is large enough to repay its import): SHA-1, fmix and the min-reduction
  fused in one compiled loop over the shingle byte slices, no Python object per shingle;
- numpy fallback: ``hashlib`` per shingle, then fmix / permutation / ``np.minimum.reduceat`` over
  the batch in bounded chunks.

Both are checked against datasketch by ``tests/unit/curation/dedup/test_dedup_minhash.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from llmpipe.curation.dedup.text import normalize, shingle_buffer, use_char_shingles

# optional accelerator (imported only when a batch uses it); the numpy path gives the same bits
HAVE_NUMBA = importlib.util.find_spec("numba") is not None
# ``auto`` takes numba for a batch of at least this many shingle-buffer bytes, or once the kernel is
# loaded: importing numba and loading its cached kernel cost ~0.75 CPU-seconds, which the numpy path
# (~0.23 us more per byte, in cache-sized chunks) spends only from ~3 MB on. Measured on the
# curation_vs_datatrove corpus: the 1,764 documents (1.07 MB) that reach dedup at 20k documents cost
# numpy 0.29 s against numba's 0.76 s; at 4,579 documents, the 288 (0.32 MB) numpy 0.09 s.
NUMBA_MIN_BYTES = 3 << 20
_NUMBA_MODULE = "llmpipe.curation.dedup.minhash_numba"

EMPTY = np.uint32(0xFFFFFFFF)  # datasketch's initial (and "empty set") hash value


def resolve_backend(backend: str, text_bytes: int) -> str:
    """The kernel for a whole run over ``text_bytes`` of text: ``auto`` is numba when it is installed
    and the run is large enough to repay loading it (``NUMBA_MIN_BYTES``), else numpy; any other
    value as given. Decided once for the run (the dedup stage), not per batch: a corpus of small
    shards would otherwise never reach the threshold in one batch and pay numpy's cost per byte."""
    if backend != "auto":
        return backend
    return "numba" if HAVE_NUMBA and text_bytes >= NUMBA_MIN_BYTES else "numpy"


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
    ``hashvalues``. ``backend``: ``"numba"``, ``"numpy"`` or ``"auto"`` (numba when installed and the
    batch holds at least ``NUMBA_MIN_BYTES`` of shingles or the kernel is already loaded; the same bits).
    """
    enc = encode(texts, langs, char_ratio=char_ratio)
    return signatures_encoded(enc, num_perm=num_perm, seed=seed, word_ngram=word_ngram,
                              char_ngram=char_ngram, backend=backend)


def signatures_encoded(enc: Encoded, *, num_perm: int, seed: int, word_ngram: int, char_ngram: int,
                       backend: str = "auto") -> np.ndarray:
    if word_ngram < 1 or char_ngram < 1:
        raise ValueError(f"shingle sizes must be >= 1, got word_ngram={word_ngram} char_ngram={char_ngram}")
    a, b = permutations(num_perm, seed)
    if backend == "auto":  # a loaded kernel costs nothing more: take it whatever the batch's size
        backend = resolve_backend(backend, NUMBA_MIN_BYTES if _NUMBA_MODULE in sys.modules else len(enc.buf))
    if backend == "numba":
        if not HAVE_NUMBA:
            raise RuntimeError("MinHash backend 'numba' requested but numba is not installed")
        out = np.empty((len(enc), num_perm), dtype=np.uint32)
        from llmpipe.curation.dedup.minhash_numba import minhash_kernel

        minhash_kernel(enc.buf, enc.offsets, enc.char_mode, word_ngram, char_ngram, a, b, out)
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
                      chunk_shingles: int = 1024) -> np.ndarray:
    """Signatures from the shingle hashes, ``chunk_shingles`` shingles at a time whatever the
    documents' sizes: a chunk's ``chunk x num_perm`` permuted hashes (1 MiB at 256 permutations) stay
    in the CPU cache, where chunks of 32k shingles (32 MiB) cost 7x more. A document that spans
    chunks takes the minimum of its parts (``min`` is associative: the same bits)."""
    hashes, offsets = shingle_hashes(enc, word_ngram, char_ngram)
    mixed = fmix32(hashes)
    out = np.full((len(enc), len(a)), EMPTY, dtype=np.uint32)
    phv = np.empty((chunk_shingles, len(a)), dtype=np.uint32)
    for lo in range(0, len(mixed), chunk_shingles):
        hi = min(lo + chunk_shingles, len(mixed))
        part = phv[: hi - lo]
        np.multiply(mixed[lo:hi, None], a[None, :], out=part)
        np.add(part, b[None, :], out=part)
        # the documents with shingles in [lo, hi), and where each one's shingles start in the chunk
        d0 = int(np.searchsorted(offsets, lo, side="right")) - 1
        d1 = int(np.searchsorted(offsets, hi, side="left"))
        starts, ends = np.maximum(offsets[d0:d1], lo), np.minimum(offsets[d0 + 1 : d1 + 1], hi)
        docs = np.flatnonzero(ends > starts)
        rows = docs + d0
        out[rows] = np.minimum(out[rows], np.minimum.reduceat(part, starts[docs] - lo, axis=0))
    return out
