"""The numba kernel of :mod:`llmpipe.curation.dedup.minhash`: SHA-1, fmix and the min-reduction
fused in one compiled loop over the shingle byte slices, no Python object per shingle.

A module of its own so that importing :mod:`~llmpipe.curation.dedup.minhash` does not import numba
(~0.2 CPU-seconds) and load the cached kernel (~0.3 s): ``backend="auto"`` uses this kernel only for
batches large enough to repay that (see ``minhash.NUMBA_MIN_BYTES``).
"""

from __future__ import annotations

import numba
import numpy as np

u64 = np.uint64
mask = u64(0xFFFFFFFF)


@numba.njit(cache=True, inline="always")
def rotl(x, n):
    return ((x << u64(n)) | (x >> u64(32 - n))) & mask

@numba.njit(cache=True, inline="always")
def _load_words(src, base, w):
    for t in range(16):
        p = base + 4 * t
        w[t] = (u64(src[p]) << u64(24)) | (u64(src[p + 1]) << u64(16)) | (u64(src[p + 2]) << u64(8)) | \
            u64(src[p + 3])


@numba.njit(cache=True, inline="always")
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


@numba.njit(cache=True)
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


@numba.njit(cache=True, inline="always")
def fmix(h):
    h ^= h >> u64(16)
    h = (h * u64(0x85EBCA6B)) & mask
    h ^= h >> u64(13)
    h = (h * u64(0xC2B2AE35)) & mask
    h ^= h >> u64(16)
    return h

@numba.njit(cache=True)
def minhash_kernel(buf, offsets, char_mode, word_n, char_n, a, b, out):
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
