"""The ``tokenize`` stage: encode, split train/val, mix, and pack into fixed-length token shards.

Two passes:

1. **Encode** (per piece of an input shard, at most ``piece_docs`` documents, in parallel, cached per
   piece with ``ctx.cached_map``; on the local executor the pieces run on threads sharing one tokenizer,
   since encoding releases the GIL): every document is encoded with the bare ``tokenizers`` library
   (special-token strings in text stay plain text),
   followed by EOS (and preceded by BOS when ``add_bos``). Each document is assigned a split by a hash
   of ``parent_id or id`` (plus ``split_salt``): a document is in ``val`` when that hash falls below
   ``val_fraction`` and it has no parent. A child (augmented document) of a validation document is
   dropped (``child_of_val``), and a child of a training document is in ``train``: no augmented
   document and no relative of a validation document ever trains. The split of an original document
   depends only on its id, so it is stable when a refresh adds shards. Documents with fewer than
   ``min_tokens`` tokens are dropped (``too_short``); longer than ``max_tokens`` are split into
   pieces (each ending with EOS) or truncated (``long_docs``).
2. **Mix and pack** (one pass over the encoded shards): train segments are up- or down-sampled by
   ``language_weights`` x ``source_weights`` (or to the target ``language_shares``), times each
   document's ``metadata["recency_weight"]`` (the timeliness stage's half-life weight, 1 where absent;
   ``recency_weighting: false`` ignores it), with deterministic error diffusion in hash order: a
   segment whose factor is ``f`` gets ``floor(f)`` or ``ceil(f)`` copies, and every (language,
   source) group gets its token target within one document's length. With ``language_shares`` the
   shares are met after the recency weights. Copies are emitted in rounds (all first copies, then all
   second copies, ...), never next to each other. Validation is never mixed: it keeps the corpus'
   natural distribution.

Artifact layout (``<dir>``)::

    index.json          {"format": "llmpipe-packed/1", "seq_len", "dtype", "vocab_size", "eos_id",
                         "bos_id", "pad_id", "languages": [...], "splits": {"train"|"val":
                         {"sequences", "tokens", "shards": [{"file", "sequences", "tokens"}]}}}
    train-00000.bin     raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    val-00000.bin
    val-00000.lang.npy  uint8 per token: index into index["languages"]; 255 marks padding
    train-00000.entity.npy, val-00000.entity.npy  (only with ``entity_mask``; index: "entity_mask": true,
                        each shard's "entity_file") uint8 per token: 1 where the token's characters overlap
                        an entity span of ``metadata["entities"]``, 0 elsewhere (EOS, BOS, padding)
    val_meta.json       {"languages", "per_language": {lang: {"docs", "bytes", "tokens"}},
                         "total_docs", "total_bytes", "total_tokens"}

Each encoded piece (a cached task of pass 1) holds ``tokens.bin``, ``segments.npy`` (the segment
table), ``weights.npy`` (float64 per segment: its document's ``recency_weight``) and ``shard.json``.

A shard with ``n`` sequences holds ``n * seq_len + 1`` ids; sequence ``i`` is
``ids[i*seq_len : i*seq_len + seq_len + 1]`` (input = first ``seq_len``, target = last ``seq_len``),
so every token but a shard's first is a target exactly once. Only the first ``tokens`` ids of a shard
are real; the tail of the last shard of a split is padded with ``pad_id``. ``val_meta.json`` gives
the UTF-8 bytes behind the validation tokens (EOS included in ``tokens``): bits per byte =
sum of target NLL (nats) / ln 2 / total_bytes, per language with the ``.lang.npy`` arrays.
Read it with :class:`llmpipe.tokenization.dataset.PackedDataset`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

from llmpipe.document import input_shards
from llmpipe.lazy import lazy_import
from llmpipe.memory import gc_paused
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json
from llmpipe.tokenization.config import TokenizeConfig
from llmpipe.tokenization.layout import TOKENIZE, TOKENIZER
from llmpipe.tokenization.tokenizer import load_for_encoding
from llmpipe.tokenization.tokenizers_adapter import encode_on_calling_thread

np = lazy_import("numpy")  # loaded when the stage runs, not when it registers
pa = lazy_import("pyarrow")
pq = lazy_import("pyarrow.parquet")

VERSION = "2"  # 2: recency weights in the mix (weights.npy per piece), copies floor/ceil of the factor
FORMAT = "llmpipe-packed/1"


TRAIN, VAL, DROPPED = 0, 1, 2
PAD_LANG = 255
# segment table columns (int64): token offset, token count, lang index, source index, split, bytes,
# mixing order, split group key (63-bit hash of parent_id or id), is-child flag
SEG_COLS = 9

_TOKENIZERS: dict[str, tuple[Any, re.Pattern[str] | None, dict[str, Any]]] = {}
_ESCAPING: dict[str, Any] = {}
_LOAD_LOCK = threading.Lock()  # encode threads share one tokenizer per process: load it once
_COLUMNS = ["id", "text", "source", "metadata"]
RECENCY = "recency_weight"  # the metadata field the timeliness stage writes (half_life_days)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def split_key(salt: str, group: str) -> int:
    """A 63-bit hash of the document group: stable across runs, machines and refreshes."""
    return group_keys(salt, group)[0]


def group_keys(salt: str, group: str) -> tuple[int, int]:
    """(split key, mixing order key) of a group from one hash: both 63-bit."""
    h = hashlib.blake2b(f"split\x00{salt}\x00{group}".encode(), digest_size=16).digest()
    return int.from_bytes(h[:8], "big") >> 1, int.from_bytes(h[8:], "big") >> 1


def order_hash(doc_id: str) -> int:
    """The mixing order of a document (63 bits, fits int64)."""
    return int.from_bytes(hashlib.blake2b(f"mix\x00{doc_id}".encode(), digest_size=8).digest(), "big") >> 1


def assign_split(doc_id: str, parent_id: str | None, cfg: TokenizeConfig) -> tuple[int | None, int, int]:
    """(TRAIN, VAL or None, group key, mixing order key) of a document.

    None marks a child of a validation document: dropped, since training on it would leak val.
    :func:`batch_keys` computes the same for a whole batch.
    """
    key, order = group_keys(cfg.split_salt, parent_id or doc_id)
    in_val = key < cfg.val_fraction * 2**63
    if parent_id:
        return (None if in_val else TRAIN), key, order_hash(doc_id)
    return (VAL if in_val else TRAIN), key, order


def batch_keys(ids: list[str], parents: list[Any], cfg: TokenizeConfig) -> tuple[np.ndarray, ...]:
    """(split, group key, mixing order key, is-child) arrays of a batch, as :func:`assign_split` per document.

    ``split`` is DROPPED for a child of a validation document. One blake2b per document (two for a
    child) and everything else in numpy: the per-document version was a fifth of the stage's Python.
    """
    blake = hashlib.blake2b
    pre = f"split\x00{cfg.split_salt}\x00".encode()
    digests = b"".join([blake(pre + str(p or i).encode(), digest_size=16).digest()
                        for i, p in zip(ids, parents, strict=True)])
    keys = (np.frombuffer(digests, dtype=">u8").reshape(-1, 2) >> 1).astype(np.int64)
    group, order = keys[:, 0].copy(), keys[:, 1].copy()
    child = np.fromiter((bool(p) for p in parents), dtype=bool, count=len(parents))
    if child.any():
        idx = np.flatnonzero(child)
        mix = b"".join([blake(b"mix\x00" + str(ids[i]).encode(), digest_size=8).digest() for i in idx.tolist()])
        order[idx] = (np.frombuffer(mix, dtype=">u8") >> 1).astype(np.int64)
    # key < val_fraction * 2**63 (a float) exactly: compare with the smallest integer not below it
    in_val = group < math.ceil(cfg.val_fraction * 2**63)
    split = np.where(in_val, np.where(child, DROPPED, VAL), TRAIN).astype(np.int64)
    return split, group, order, child.astype(np.int64)


def _tokenizer(tok_dir: str) -> tuple[Any, re.Pattern[str] | None, dict[str, Any]]:
    """(plain tokenizer, special-token regex, metadata), loaded once per process.

    Escaping special tokens costs ~8% of encoding time, so the plain tokenizer encodes every batch and
    only a document that contains a special token's text is encoded again by :func:`_escaping`.
    """
    with _LOAD_LOCK:
        if tok_dir not in _TOKENIZERS:
            _TOKENIZERS[tok_dir] = _load_plain(tok_dir)
        return _TOKENIZERS[tok_dir]


def _load_plain(tok_dir: str) -> tuple[Any, re.Pattern[str] | None, dict[str, Any]]:
    from tokenizers import Tokenizer

    plain = Tokenizer.from_file(str(Path(tok_dir) / TOKENIZER.tokenizer))
    plain.no_truncation()
    plain.no_padding()
    specials = [t.content for t in plain.get_added_tokens_decoder().values() if t.special]
    pattern = re.compile("|".join(re.escape(x) for x in specials)) if specials else None
    return plain, pattern, json.loads((Path(tok_dir) / TOKENIZER.meta).read_text())


def _escaping(tok_dir: str) -> Any:
    """The special-escaping tokenizer, loaded on first need (most shards never need it)."""
    with _LOAD_LOCK:
        if tok_dir not in _ESCAPING:
            _ESCAPING[tok_dir] = load_for_encoding(tok_dir)[0]
        return _ESCAPING[tok_dir]


class _Batch(NamedTuple):
    ids: list[str]
    texts: list[str]
    sources: list[str]
    metas: list[dict[str, Any]]
    n_bytes: np.ndarray  # UTF-8 bytes per text (int64), from Arrow: no str.encode per document


class _Encoded(NamedTuple):
    lengths: np.ndarray  # tokens per document (int64)
    ids: np.ndarray  # every document's ids, concatenated
    cut_chars: dict[int, int]  # document -> characters behind its first max_tokens ids (truncation only)
    mask: np.ndarray | None = None  # uint8 per id: the token overlaps an entity span (entity_mask only)


def entity_mask(offsets: Any, spans: Any) -> np.ndarray:
    """1 for each token whose character range ``[a, b)`` overlaps a span (sorted, non-overlapping).

    The last span starting before ``b`` is the only candidate: spans never overlap, so their ends
    increase with their starts.
    """
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans or not off.size:
        return np.zeros(len(off), dtype=np.uint8)
    starts = np.asarray([sp["start"] for sp in spans], dtype=np.int64)
    ends = np.asarray([sp["end"] for sp in spans], dtype=np.int64)
    j = np.searchsorted(starts, off[:, 1], side="left") - 1
    hit = (j >= 0) & (ends[np.maximum(j, 0)] > off[:, 0]) & (off[:, 1] > off[:, 0])
    return hit.astype(np.uint8)


def _parse_metadata(metas: list[str]) -> list[dict[str, Any]]:
    """Every metadata JSON string of a batch in one parse call instead of one call per document."""
    text = "[" + ",".join([m or "{}" for m in metas]) + "]"
    try:
        import orjson
    except ImportError:  # pragma: no cover
        return json.loads(text)
    return orjson.loads(text)


def _utf8_lengths(arr: Any, texts: list[str]) -> np.ndarray:
    """UTF-8 bytes per string, read off the Arrow offsets (``pyarrow.compute`` takes ~80 ms to import)."""
    width = {pa.string(): np.int32, pa.large_string(): np.int64}.get(arr.type)
    if width is None:
        return np.fromiter((len(t.encode("utf-8")) for t in texts), np.int64, len(texts))
    offsets = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset : arr.offset + len(arr) + 1]
    return np.diff(offsets).astype(np.int64)


def _record_batches(path: str, size: int, start: int, stop: int | None) -> Iterator[Any]:
    """Rows ``[start, stop)`` of a shard as Arrow record batches of at most ``size`` rows.

    ``use_threads=False``: workers already run in parallel, and pyarrow's thread pool, started
    afresh in a forked worker whose parent encoded before, cost 0.2-0.4 CPU-s on its first read.
    """
    at = 0
    for rb in pq.ParquetFile(path).iter_batches(batch_size=size, columns=_COLUMNS, use_threads=False):
        lo, hi = max(start - at, 0), rb.num_rows if stop is None else min(stop - at, rb.num_rows)
        at += rb.num_rows
        if hi > lo:
            yield rb if (lo, hi) == (0, rb.num_rows) else rb.slice(lo, hi - lo)
        if stop is not None and at >= stop:
            return


def _read_batches(path: str, size: int, max_chars: int, start: int = 0, stop: int | None = None) -> Iterator[_Batch]:
    """Rows ``[start, stop)`` of a shard in batches of at most ``size`` documents or about ``max_chars`` characters.

    Reads the columns with pyarrow: a ``Document`` per row (``iter_documents``) cost as much as all
    the other per-document work. Characters are counted as UTF-8 bytes (never fewer); batch
    boundaries never change the output.
    """
    for rb in _record_batches(path, size, start, stop):
        ids, texts, sources = (rb.column(c).to_pylist() for c in ("id", "text", "source"))
        metas = _parse_metadata(rb.column("metadata").to_pylist())
        n_bytes = _utf8_lengths(rb.column("text"), texts)
        cum = np.cumsum(n_bytes)
        start = 0
        while start < rb.num_rows:  # a batch ends with the document that reaches max_chars
            end = min(rb.num_rows, int(np.searchsorted(cum, (cum[start - 1] if start else 0) + max_chars)) + 1)
            yield _Batch(ids[start:end], texts[start:end], sources[start:end], metas[start:end], n_bytes[start:end])
            start = end


def _encode(tok: Any, special_re: re.Pattern[str] | None, tok_dir: str, texts: list[str], dtype: np.dtype,
            cut: int | None, spans: list[Any] | None = None) -> _Encoded:
    """The ids of ``texts`` (special-token strings in them encoded as plain text), as arrays.

    Runs in the encode thread, which also reads the ids out and frees the ``Encoding`` objects: freed
    by the main thread (another malloc arena) they cost about as much as the rest of its work.
    ``cut``: with truncation, the characters behind the first ``cut`` ids of each longer document.
    ``spans``: each document's entity spans, for the entity mask (None: no mask).
    """
    # encode_batch, not encode_batch_fast: the latter runs fewer instructions (no char offsets) but
    # measured 15-20% more CPU time here (tokenizers 0.23); encode_batch also gives truncation offsets
    encs = tok.encode_batch(texts, add_special_tokens=False)
    if special_re is not None:
        search = special_re.search
        for i, t in enumerate(texts):
            if search(t):  # rare: a special token's text inside a document
                encs[i] = _escaping(tok_dir).encode(t, add_special_tokens=False)
    lengths = np.fromiter(map(len, encs), dtype=np.int64, count=len(encs))
    ids = np.fromiter(chain.from_iterable(e.ids for e in encs), dtype=dtype, count=int(lengths.sum()))
    cuts = {} if cut is None else {i: encs[i].offsets[cut - 1][1] for i in np.flatnonzero(lengths > cut).tolist()}
    if spans is None:
        return _Encoded(lengths, ids, cuts)
    masks = [entity_mask(e.offsets, sp) if sp else np.zeros(len(e), np.uint8) for e, sp in zip(encs, spans, strict=True)]
    return _Encoded(lengths, ids, cuts, np.concatenate(masks) if masks else np.zeros(0, np.uint8))


_LOCAL = threading.local()


def _encode_pool() -> ThreadPoolExecutor:
    """The calling worker's encode thread, kept across shards.

    ``tokenizers`` keeps its BPE word cache per thread: a new thread per shard would start each
    shard with a cold cache when the library encodes in the calling thread (a forked worker, or
    ``TOKENIZERS_PARALLELISM=false``). One per worker thread, so pieces on threads encode at once;
    thread-local, so it ends with its worker thread (a dropped executor stops its thread); keyed by
    pid too: threads do not survive ``fork``.
    """
    mine = getattr(_LOCAL, "pool", None)
    if mine is None or mine[0] != os.getpid():
        mine = _LOCAL.pool = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmpipe-encode"))
    return mine[1]


class _ShardBuilder:
    """Encoded batches -> the shard's token array and segment table, with numpy instead of a loop per token.

    Lengths, drops, pieces, EOS/BOS placement and segment rows are array operations; Python touches a
    kept document only to index its language and source.
    """

    def __init__(self, cfg: TokenizeConfig, dtype: np.dtype, eos: int, bos: int | None) -> None:
        self.cfg, self.dtype, self.eos, self.bos = cfg, dtype, eos, bos
        self.head = 1 if cfg.add_bos else 0
        self.langs: dict[str, int] = {}
        self.sources: dict[str, int] = {}
        self.dropped: dict[str, int] = defaultdict(int)
        self.counts = {"docs": 0, "truncated": 0, "split_docs": 0}
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []  # entity masks beside the tokens (entity_mask only)
        self.segs: list[np.ndarray] = []
        self.weights: list[np.ndarray] = []  # recency weight per segment, aligned with segs
        self.size = 0

    def _drop(self, reason: str, n: int) -> None:
        if n:
            self.dropped[reason] += n

    def add(self, batch: _Batch, keys: tuple[np.ndarray, ...], enc: _Encoded) -> None:
        split, group, order, child = keys
        n = enc.lengths
        self.counts["docs"] += n.size
        live = split != DROPPED
        short = live & (n < self.cfg.min_tokens)
        self._drop("child_of_val", n.size - int(live.sum()))
        self._drop("too_short", int(short.sum()))
        kept = np.flatnonzero(live & ~short)
        if not kept.size:
            return
        k, nk = kept.tolist(), n[kept]
        raw = enc.ids if kept.size == n.size else gather(enc.ids, (np.cumsum(n) - n)[kept], nk)
        mask = enc.mask if enc.mask is None or kept.size == n.size else gather(enc.mask, (np.cumsum(n) - n)[kept], nk)
        cdoc, ci, clen = self._pieces(nk)
        n_bytes = batch.n_bytes[kept]
        if clen.sum() < raw.size:  # truncated: keep each piece's head; bytes up to its last token
            raw = gather(raw, (np.cumsum(nk) - nk)[cdoc], clen)
            mask = None if mask is None else gather(mask, (np.cumsum(nk) - nk)[cdoc], clen)
            for j in np.flatnonzero(nk > clen).tolist():
                n_bytes[j] = len(batch.texts[k[j]][: enc.cut_chars[k[j]]].encode("utf-8"))
        out, starts, seg_len = self._place(raw, clen)
        if mask is not None:  # the same places, 0 at EOS/BOS
            placed = np.zeros(out.size, dtype=np.uint8)
            placed[self._slots(clen)] = mask
            self.masks.append(placed)
        langs = self.langs
        sources = self.sources
        li = np.asarray([langs.setdefault(str(batch.metas[i].get("lang") or "und"), len(langs)) for i in k],
                        dtype=np.int64)
        si = np.asarray([sources.setdefault(batch.sources[i], len(sources)) for i in k], dtype=np.int64)
        d = kept[cdoc]
        # bytes are attributed to the first piece (bits-per-byte sums over the split)
        self.segs.append(np.stack([self.size + starts, seg_len, li[cdoc], si[cdoc], split[d],
                                   np.where(ci == 0, n_bytes[cdoc], 0), order[d] + ci, group[d], child[d]], axis=1))
        self.weights.append(recency_weights([batch.metas[i] for i in k], [batch.ids[i] for i in k])[cdoc])
        self.tokens.append(out)
        self.size += out.size

    def _pieces(self, nk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document, piece index, tokens) per piece: long documents are split or truncated."""
        m = self.cfg.max_tokens
        docs = np.arange(nk.size)
        if m is None or not (nk > m).any():
            return docs, np.zeros(nk.size, np.int64), nk
        if self.cfg.long_docs == "truncate":
            self.counts["truncated"] += int((nk > m).sum())
            return docs, np.zeros(nk.size, np.int64), np.minimum(nk, m)
        pieces = (nk + m - 1) // m
        self.counts["split_docs"] += int((pieces > 1).sum())
        cdoc = np.repeat(docs, pieces)
        ci = np.arange(cdoc.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        return cdoc, ci, np.minimum(m, nk[cdoc] - ci * m)

    def _place(self, raw: np.ndarray, clen: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, piece starts, piece lengths): each piece is [BOS] + its ids + EOS, in order."""
        h = self.head
        seg_len = clen + (h + 1)
        ends = np.cumsum(seg_len)
        starts = ends - seg_len
        out = np.empty(int(ends[-1]), dtype=self.dtype)
        out[ends - 1] = self.eos
        if h:
            out[starts] = self.bos
        out[self._slots(clen)] = raw
        return out, starts, seg_len

    def _slots(self, clen: np.ndarray) -> np.ndarray:
        """Where the pieces' ids go in the placed array (after each piece's BOS, before its EOS)."""
        h = self.head
        return np.arange(int(clen.sum())) + np.repeat(np.arange(clen.size) * (h + 1) + h, clen)

    def finish(self, out_dir: Path) -> dict[str, Any]:
        """Write ``tokens.bin``, ``segments.npy`` and ``shard.json``; returns the shard's stats."""
        tokens = np.concatenate(self.tokens) if self.tokens else np.zeros(0, self.dtype)
        segs = np.concatenate(self.segs) if self.segs else np.zeros((0, SEG_COLS), np.int64)
        tokens.tofile(out_dir / "tokens.bin")
        if self.cfg.entity_mask:
            (np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8)).tofile(out_dir / "entity.bin")
        np.save(out_dir / "segments.npy", segs.astype(np.int64, copy=False))
        np.save(out_dir / "weights.npy", np.concatenate(self.weights) if self.weights else np.zeros(0))
        info = {"languages": list(self.langs), "sources": list(self.sources), "dtype": self.dtype.name}
        (out_dir / "shard.json").write_text(json.dumps(info, sort_keys=True))
        kept = self.counts["docs"] - sum(self.dropped.values())
        return {**self.counts, "kept": kept, "dropped": dict(self.dropped), "tokens": int(tokens.size)}


def recency_weights(metas: list[dict[str, Any]], ids: list[str]) -> np.ndarray:
    """``metadata["recency_weight"]`` per document as float64: 1.0 where absent (or null).

    Read whether or not ``recency_weighting`` is on, so switching it re-mixes without re-encoding; a
    value that is not a finite number >= 0 is an error naming the document.
    """
    vals = [m.get(RECENCY) for m in metas]
    out = np.ones(len(vals), dtype=np.float64)
    for j, v in enumerate(vals):
        if v is None:
            continue
        if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"tokenize: document {ids[j]!r}: metadata.{RECENCY} must be a number >= 0 "
                             f"(the timeliness stage's half-life weight), got {v!r}")
        out[j] = v
    return out


@dataclass(frozen=True)
class EncodeJob:
    """One shard job of pass 1: encode rows ``[start, stop)`` of one input shard (a piece, see
    :func:`pieces`) with the tokenizer in ``tokenizer`` and the stage's settings."""

    path: str  # the input shard
    tokenizer: str  # the tokenizer stage's artifact directory
    config: TokenizeConfig
    start: int = 0
    stop: int | None = None  # None: to the shard's end


def encode_shard(job: EncodeJob, out_dir: Path) -> dict[str, Any]:
    """Pass 1 for rows ``[start, stop)`` of an input shard: ``tokens.bin``, ``segments.npy``, ``shard.json``."""
    path, tok_dir, cfg, start, stop = job.path, job.tokenizer, job.config, job.start, job.stop
    tok, special_re, meta = _tokenizer(tok_dir)
    if cfg.add_bos and meta.get("bos_id") is None:
        raise ValueError("tokenize.add_bos: the tokenizer has no bos token")
    dtype = token_dtype(meta["vocab_size"])
    builder = _ShardBuilder(cfg, dtype, meta["eos_id"], meta.get("bos_id"))
    cut = cfg.max_tokens if cfg.long_docs == "truncate" else None
    with gc_paused():  # many small allocations and no cycles: the collector only costs time here
        # encoding releases the GIL: encode batch k+1 in a thread while Python hashes its ids and packs
        # batch k
        pool = _encode_pool()
        pending: tuple[_Batch, tuple[np.ndarray, ...], Future[_Encoded]] | None = None
        for batch in _read_batches(path, cfg.batch_size, cfg.batch_chars, start, stop):
            spans = [m.get("entities") or [] for m in batch.metas] if cfg.entity_mask else None
            fut = pool.submit(_encode, tok, special_re, tok_dir, batch.texts, dtype, cut, spans)
            keys = batch_keys(batch.ids, [m.get("parent_id") for m in batch.metas], cfg)
            if pending is not None:
                builder.add(pending[0], pending[1], pending[2].result())
            pending = (batch, keys, fut)
        if pending is not None:
            builder.add(pending[0], pending[1], pending[2].result())
    return builder.finish(out_dir)


def pieces(rows: int, piece_docs: int) -> list[tuple[int, int | None]]:
    """Row ranges of about equal size, none over ``piece_docs``; one open range for a small shard.

    Pieces are the encode tasks. With a few large shards, whole shards as tasks leave a worker idle
    while another finishes its last shard; pieces in shard order give the same output.
    """
    n = max(1, -(-rows // piece_docs))
    if n == 1:
        return [(0, None)]
    bounds = [rows * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


# -- pass 2: mixing ---------------------------------------------------------------------------------

def mixing_multipliers(train_tokens: dict[tuple[str, str], float], cfg: TokenizeConfig
                       ) -> dict[tuple[str, str], float]:
    """Sampling factor per (language, source) group of the train split (tokens: recency-weighted)."""
    mult = {g: cfg.language_weights.get(g[0], 1.0) * cfg.source_weights.get(g[1], 1.0) for g in train_tokens}
    if not cfg.language_shares:
        return mult
    weighted: dict[str, float] = defaultdict(float)
    for g, t in train_tokens.items():
        weighted[g[0]] += t * mult[g]
    missing = [lang for lang, s in cfg.language_shares.items() if s > 0 and weighted.get(lang, 0) <= 0]
    if missing:
        raise ValueError(f"tokenize.language_shares: languages {missing} have a share but no train tokens "
                         f"(recency-weighted; present: {sorted(k for k, w in weighted.items() if w > 0)})")
    total = sum(weighted.values())
    lang_m = {lang: cfg.language_shares.get(lang, 0.0) * total / w for lang, w in weighted.items() if w > 0}
    return {g: m * lang_m.get(g[0], 0.0) for g, m in mult.items()}


def copies_by_error_diffusion(lengths: np.ndarray, multiplier: float | np.ndarray) -> np.ndarray:
    """Copies per segment so the group's emitted tokens track ``multiplier`` x its tokens.

    ``multiplier`` is one factor or one per segment (the group's times each document's recency
    weight). A segment with factor ``f`` gets ``floor(f)`` copies, plus one more when the carried
    error says so (never for an integer ``f``): a weight-0 document is never emitted, a weight-1
    document at factor 1 always exactly once, and the group's emitted tokens stay within half a
    document of the target (the error only grows by a fraction of a segment, and shrinks by the rest).
    """
    f = np.broadcast_to(np.asarray(multiplier, dtype=np.float64), lengths.shape)
    if (f < 0).any():
        raise ValueError(f"tokenize: negative sampling factor {float(f.min())}")
    base = np.floor(f)
    frac = f - base
    out = base.astype(np.int64)
    idx = np.flatnonzero(frac > 0)
    extra = np.zeros(idx.size, dtype=np.int64)
    acc = 0.0
    for j, (t, p) in enumerate(zip(lengths[idx].tolist(), frac[idx].tolist(), strict=True)):
        acc += p * t  # error diffusion over the fractional parts, in order
        if acc >= t / 2:
            extra[j] = 1
            acc -= t
    out[idx] += extra
    return out


# -- pass 2: packing --------------------------------------------------------------------------------

class Packer:
    """Stream token arrays into fixed-length sequence shards (``<split>-NNNNN.bin``)."""

    def __init__(self, out: Path, split: str, seq_len: int, per_shard: int, dtype: np.dtype, pad_id: int,
                 with_lang: bool = False, with_entity: bool = False) -> None:
        self.out, self.split, self.L, self.S = out, split, seq_len, per_shard
        self.dtype, self.pad_id, self.with_lang, self.with_entity = dtype, pad_id, with_lang, with_entity
        self.buf: list[np.ndarray] = []
        self.lbuf: list[np.ndarray] = []
        self.ebuf: list[np.ndarray] = []  # entity masks, aligned with buf
        self.n = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, tokens: np.ndarray, langs: np.ndarray | None = None, entity: np.ndarray | None = None) -> None:
        if tokens.size == 0:
            return
        self.buf.append(tokens)
        if self.with_lang:
            assert langs is not None
            self.lbuf.append(langs)
        if self.with_entity:
            assert entity is not None and entity.size == tokens.size
            self.ebuf.append(entity)
        self.n += tokens.size
        need = self.S * self.L + 1
        while self.n >= need:
            self._write(need, need)

    def _write(self, real: int, size: int) -> None:
        flat = np.concatenate(self.buf)
        arr = np.full(size, self.pad_id, dtype=self.dtype)
        arr[:real] = flat[:real]
        name = f"{self.split}-{len(self.shards):05d}.bin"
        arr.tofile(self.out / name)
        entry = {"file": name, "sequences": (size - 1) // self.L, "tokens": real}
        if self.with_lang:
            lflat = np.concatenate(self.lbuf)
            larr = np.full(size, PAD_LANG, dtype=np.uint8)
            larr[:real] = lflat[:real]
            lname = f"{self.split}-{len(self.shards):05d}.lang.npy"
            np.save(self.out / lname, larr)
            entry["lang_file"] = lname
            self.lbuf = [lflat[real - 1 :]]
        if self.with_entity:
            eflat = np.concatenate(self.ebuf)
            earr = np.zeros(size, dtype=np.uint8)
            earr[:real] = eflat[:real]
            ename = f"{self.split}-{len(self.shards):05d}{TOKENIZE.entity_suffix}"
            np.save(self.out / ename, earr)
            entry["entity_file"] = ename
            self.ebuf = [eflat[real - 1 :]]
        self.shards.append(entry)
        self.buf = [flat[real - 1 :]]  # the last id is the next shard's first input
        self.n = self.buf[0].size

    def close(self) -> dict[str, Any]:
        if self.n > 1:
            n_seq = math.ceil((self.n - 1) / self.L)
            self._write(self.n, n_seq * self.L + 1)
        # each shard after the first repeats its predecessor's last id: count distinct tokens
        distinct = sum(s["tokens"] for s in self.shards) - max(0, len(self.shards) - 1)
        return {"sequences": sum(s["sequences"] for s in self.shards), "tokens": distinct,
                "shards": self.shards}


def gather(arr: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arr[s : s + n]`` for each (s, n) without a Python loop per segment.

    Segments that continue where the previous one ended are copied as one slice: a split keeps most
    of a shard's segments in order, so this is a few ``memcpy`` instead of an index per token.
    """
    total = int(lengths.sum())
    if total == 0:
        return arr[:0]
    ends = starts + lengths
    brk = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    if brk.size * 64 < total:  # long runs: slice copies
        first, last = np.r_[0, brk], np.r_[brk - 1, starts.size - 1]
        return np.concatenate([arr[s:e] for s, e in zip(starts[first].tolist(), ends[last].tolist(), strict=True)])
    cum = np.cumsum(lengths)
    idx = np.arange(total) - np.repeat(cum - lengths, lengths) + np.repeat(starts, lengths)
    return arr[idx]


def _load_shards(results: list[tuple[Path, dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Per-shard segment tables remapped to global language/source indices."""
    langs: dict[str, int] = {}
    sources: dict[str, int] = {}
    shards = []
    for d, _st in results:
        info = json.loads((d / "shard.json").read_text())
        segs = np.load(d / "segments.npy")
        lmap = np.asarray([langs.setdefault(x, len(langs)) for x in info["languages"]] or [0], dtype=np.int64)
        smap = np.asarray([sources.setdefault(x, len(sources)) for x in info["sources"]] or [0], dtype=np.int64)
        if len(segs):
            segs[:, 2] = lmap[segs[:, 2]]
            segs[:, 3] = smap[segs[:, 3]]
        weights = np.load(d / "weights.npy")
        if weights.shape != (len(segs),):
            raise ValueError(f"tokenize: {d / 'weights.npy'} holds {weights.shape} weights for {len(segs)} segments")
        shards.append({"dir": d, "segs": segs, "weights": weights, "dtype": info["dtype"]})
    return shards, list(langs), list(sources)


def ensure_min_val(shards: list[dict[str, Any]], cfg: TokenizeConfig) -> int:
    """Move the lowest-hash train groups into val until it holds ``min_val_docs`` original documents.

    Equivalent to raising the split threshold just enough, so it only matters for tiny corpora; the
    children of a moved document are dropped like any child of val. Returns the children dropped.
    """
    if cfg.val_fraction <= 0 or cfg.min_val_docs <= 0 or not shards:
        return 0
    segs = np.concatenate([s["segs"] for s in shards])
    originals = (segs[:, 8] == 0) & (segs[:, 5] > 0)
    need = cfg.min_val_docs - int((originals & (segs[:, 4] == VAL)).sum())
    if need <= 0:
        return 0
    candidates = np.unique(segs[originals & (segs[:, 4] == TRAIN), 7])[:need]
    dropped = 0
    for s in shards:
        g = s["segs"]
        hit = np.isin(g[:, 7], candidates) & (g[:, 4] == TRAIN)
        child = hit & (g[:, 8] == 1)
        dropped += int((child & (g[:, 5] > 0)).sum())
        g[hit & (g[:, 8] == 0), 4] = VAL
        g[child, 4] = DROPPED
    return dropped


def segment_weights(shards: list[dict[str, Any]], cfg: TokenizeConfig) -> np.ndarray:
    """The recency weight of every segment (all shards, in order); all 1 with ``recency_weighting`` off."""
    n = sum(len(s["segs"]) for s in shards)
    if not cfg.recency_weighting or not shards:
        return np.ones(n, dtype=np.float64)
    return np.concatenate([s["weights"] for s in shards])


def plan_copies(shards: list[dict[str, Any]], langs: list[str], sources: list[str],
                cfg: TokenizeConfig) -> tuple[list[np.ndarray], dict[tuple[str, str], float]]:
    """Copies per train segment (per shard): the group's mixing multiplier x the segment's recency
    weight, by error diffusion. ``language_shares`` see the recency-weighted tokens, so the shares hold
    after the weights."""
    all_segs = np.concatenate([s["segs"] for s in shards]) if shards else np.zeros((0, SEG_COLS), np.int64)
    weights = segment_weights(shards, cfg)
    shard_of = np.concatenate([np.full(len(s["segs"]), i) for i, s in enumerate(shards)]) if shards else \
        np.zeros(0, np.int64)
    row_of = np.concatenate([np.arange(len(s["segs"])) for s in shards]) if shards else np.zeros(0, np.int64)
    train = all_segs[:, 4] == TRAIN
    # train tokens per (language, source), the groups in order of first appearance
    gid = all_segs[train, 2] * max(1, len(sources)) + all_segs[train, 3]
    uniq, first, inv = np.unique(gid, return_index=True, return_inverse=True)
    sums = np.zeros(len(uniq), dtype=np.float64)
    np.add.at(sums, inv.reshape(-1), all_segs[train, 1] * weights[train])
    groups = {(langs[int(g) // max(1, len(sources))], sources[int(g) % max(1, len(sources))]): float(sums[j])
              for j, g in sorted(enumerate(uniq.tolist()), key=lambda x: first[x[0]])}
    mult = mixing_multipliers(groups, cfg)
    flat = np.zeros(len(all_segs), dtype=np.int64)
    for (lang, src), m in sorted(mult.items()):
        sel = np.nonzero(train & (all_segs[:, 2] == langs.index(lang)) & (all_segs[:, 3] == sources.index(src)))[0]
        order = sel[np.lexsort((row_of[sel], shard_of[sel], all_segs[sel, 6]))]
        flat[order] = copies_by_error_diffusion(all_segs[order, 1], m * weights[order])
    return np.split(flat, np.cumsum([len(s["segs"]) for s in shards])[:-1]) if shards else [], mult


def _sum_by(index: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """``out[i] = values[index == i].sum()`` for i < n, in exact int64."""
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, index, values)
    return out


def pack(shards: list[dict[str, Any]], copies: list[np.ndarray], out: Path, cfg: TokenizeConfig,
         meta: dict[str, Any]) -> dict[str, Any]:
    """Write the train and val sequence shards; returns the per-split index entries."""
    dtype = token_dtype(meta["vocab_size"])
    ent = cfg.entity_mask
    train = Packer(out, "train", cfg.seq_len, cfg.sequences_per_shard, dtype, meta["pad_id"], with_entity=ent)
    val = Packer(out, "val", cfg.seq_len, cfg.sequences_per_shard, dtype, meta["pad_id"], with_lang=True,
                 with_entity=ent)
    rounds = max((int(c.max()) for c in copies if len(c)), default=0)
    for s in shards:  # validation: one copy, with its language per token
        segs = s["segs"]
        if not len(segs):
            continue
        toks = np.fromfile(s["dir"] / "tokens.bin", dtype=s["dtype"]).astype(dtype, copy=False)
        v = segs[:, 4] == VAL
        val.add(gather(toks, segs[v, 0], segs[v, 1]),
                np.repeat(segs[v, 2].astype(np.uint8), segs[v, 1]),
                gather(_entity_of(s), segs[v, 0], segs[v, 1]) if ent else None)
    for r in range(rounds):
        for s, c in zip(shards, copies, strict=True):
            segs = s["segs"]
            take = c > r
            if not take.any():
                continue
            toks = np.fromfile(s["dir"] / "tokens.bin", dtype=s["dtype"]).astype(dtype, copy=False)
            train.add(gather(toks, segs[take, 0], segs[take, 1]),
                      entity=gather(_entity_of(s), segs[take, 0], segs[take, 1]) if ent else None)
    return {"train": train.close(), "val": val.close()}


def _entity_of(shard: dict[str, Any]) -> np.ndarray:
    """The entity mask beside an encoded piece's ``tokens.bin``."""
    return np.fromfile(shard["dir"] / "entity.bin", dtype=np.uint8)


def _per_language(shards: list[dict[str, Any]], copies: list[np.ndarray] | None, n_langs: int,
                  weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-language sums over the segment tables (int64 arrays indexed like ``langs``); with ``weights``
    (one per segment) also the recency-weighted train tokens, rounded."""
    segs = np.concatenate([s["segs"] for s in shards]) if shards else np.zeros((0, SEG_COLS), np.int64)
    lang, n, split = segs[:, 2], segs[:, 1], segs[:, 4]
    tr, va = split == TRAIN, split == VAL
    out = {"before": _sum_by(lang[tr], n[tr], n_langs), "val_tokens": _sum_by(lang[va], n[va], n_langs),
           "val_bytes": _sum_by(lang[va], segs[va, 5], n_langs),
           "val_docs": _sum_by(lang[va], (segs[va, 5] > 0).astype(np.int64), n_langs)}
    if copies is not None:
        k = np.concatenate(copies) if copies else np.zeros(0, np.int64)
        out["after"] = _sum_by(lang[tr], n[tr] * k[tr], n_langs)
    if weights is not None:
        w = np.zeros(n_langs, dtype=np.float64)
        np.add.at(w, lang[tr], n[tr] * weights[tr])
        out["recency"] = np.rint(w).astype(np.int64)
    return out


def _language_table(shards: list[dict[str, Any]], copies: list[np.ndarray], langs: list[str],
                    cfg: TokenizeConfig) -> list[dict[str, Any]]:
    weights = segment_weights(shards, cfg)
    per = {k: v.tolist() for k, v in _per_language(shards, copies, len(langs), weights).items()}
    before, after, val = per["before"], per["after"], per["val_tokens"]
    tb, ta = sum(before) or 1, sum(after) or 1
    return [{"lang": lang, "train_tokens_before": before[i], "train_tokens_recency": per["recency"][i],
             "train_tokens_after": after[i],
             "share_before": round(before[i] / tb, 4), "share_after": round(after[i] / ta, 4),
             "target_share": cfg.language_shares.get(lang) if cfg.language_shares else None,
             "val_tokens": val[i]} for i, lang in enumerate(langs)]


def _val_meta(shards: list[dict[str, Any]], langs: list[str]) -> dict[str, Any]:
    sums = {k: v.tolist() for k, v in _per_language(shards, None, len(langs)).items()}
    per = {lang: {"docs": sums["val_docs"][i], "bytes": sums["val_bytes"][i], "tokens": sums["val_tokens"][i]}
           for i, lang in enumerate(langs) if sums["val_tokens"][i]}
    return {"languages": langs, "per_language": per,
            "total_docs": sum(v["docs"] for v in per.values()),
            "total_bytes": sum(v["bytes"] for v in per.values()),
            "total_tokens": sum(v["tokens"] for v in per.values())}


def recency_stats(shards: list[dict[str, Any]], copies: list[np.ndarray], cfg: TokenizeConfig) -> dict[str, Any]:
    """What the recency weights did to the train split: its tokens before, recency-weighted (before the
    language/source mix), and the packed tokens of the down-weighted documents before and after."""
    segs = np.concatenate([s["segs"] for s in shards]) if shards else np.zeros((0, SEG_COLS), np.int64)
    raw = np.concatenate([s["weights"] for s in shards]) if shards else np.zeros(0)
    k = np.concatenate(copies) if copies else np.zeros(0, np.int64)
    tr = segs[:, 4] == TRAIN
    n, w = segs[tr, 1], raw[tr]
    low = w != 1.0
    weighted = float((n * w).sum()) if cfg.recency_weighting else float(n.sum())
    return {"enabled": cfg.recency_weighting,
            "weighted_docs": int((low & (segs[tr, 5] > 0)).sum()),  # documents (first pieces) with a weight != 1
            "train_tokens_before": int(n.sum()), "train_tokens_weighted": round(weighted),
            "mean_weight": round(weighted / n.sum(), 6) if n.sum() else None,
            "weighted_docs_tokens_before": int(n[low].sum()), "weighted_docs_tokens_after": int((n * k[tr])[low].sum())}


def _sum_stats(results: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    tot: dict[str, Any] = {"docs": 0, "kept": 0, "dropped": defaultdict(int), "truncated": 0, "split_docs": 0,
                           "tokens_encoded": 0}
    for _, st in results:
        for k in ("docs", "kept", "truncated", "split_docs"):
            tot[k] += st[k]
        tot["tokens_encoded"] += st["tokens"]
        for r, n in st["dropped"].items():
            tot["dropped"][r] += n
    tot["dropped"] = dict(tot["dropped"])
    return tot


@stage("tokenize", version=VERSION, inputs=("augment", "tokenizer"), config_field="tokenize", flow="data_refresh",
       requires=("tokenizers",), extra="tokenize")
def run_tokenize(ctx: StageContext) -> dict[str, Any]:
    """Encode documents, split train/val by document hash, mix, and pack fixed-length token shards."""
    cfg: TokenizeConfig = ctx.config
    src, tok_dir = ctx.inputs["augment"], ctx.inputs["tokenizer"]
    meta = json.loads((Path(tok_dir) / TOKENIZER.meta).read_text())
    enc_cfg = {k: v for k, v in cfg.key_dict().items()
               if k in ("val_fraction", "split_salt", "min_tokens", "max_tokens", "long_docs", "add_bos")}
    if cfg.entity_mask:  # off, the pieces' keys (and cache) are those of a run without the option
        enc_cfg["entity_mask"] = True
    tok_key = ctx.input_keys.get("tokenizer", "")
    items = [(hash_json(["tokenize-encode", VERSION, enc_cfg, tok_key, s.sha256, start, stop]),
              EncodeJob(str(s.path), str(tok_dir), cfg, start, stop))
             for s in input_shards(src)
             for start, stop in pieces(pq.ParquetFile(s.path).metadata.num_rows, cfg.piece_docs)]
    with encode_on_calling_thread(ctx.executor.threads_here):
        results = ctx.cached_map(encode_shard, items, desc="encode", threads=True)
    shards, langs, sources = _load_shards(results)
    moved_children = ensure_min_val(shards, cfg)
    copies, mult = plan_copies(shards, langs, sources, cfg)
    splits = pack(shards, copies, ctx.out, cfg, meta)
    index = {"format": FORMAT, "seq_len": cfg.seq_len, "dtype": token_dtype(meta["vocab_size"]).name,
             "vocab_size": meta["vocab_size"], "eos_id": meta["eos_id"], "bos_id": meta.get("bos_id"),
             "pad_id": meta["pad_id"], "languages": langs, "splits": splits}
    if cfg.entity_mask:
        index["entity_mask"] = True
    (ctx.out / TOKENIZE.index).write_text(json.dumps(index, indent=1, sort_keys=True))
    vm = _val_meta(shards, langs)
    (ctx.out / TOKENIZE.val_meta).write_text(json.dumps(vm, indent=1, sort_keys=True))
    table = _language_table(shards, copies, langs, cfg)
    recency = recency_stats(shards, copies, cfg)
    if recency["weighted_docs"] and not cfg.recency_weighting:
        ctx.log.info("tokenize: %d documents carry a recency_weight != 1; recency_weighting is off",
                     recency["weighted_docs"])
    ctx.report_table("tokenize-languages", "Train tokens per language before/after mixing", table)
    stats = _sum_stats(results)
    if moved_children:
        stats["kept"] -= moved_children
        stats["dropped"]["child_of_val"] = stats["dropped"].get("child_of_val", 0) + moved_children
    if cfg.val_fraction > 0 and splits["val"]["sequences"] == 0:
        ctx.log.warning("tokenize: the validation split is empty (val_fraction=%s)", cfg.val_fraction)
    stats.update({
        "train_sequences": splits["train"]["sequences"], "val_sequences": splits["val"]["sequences"],
        "train_tokens": splits["train"]["tokens"], "val_tokens": splits["val"]["tokens"],
        "val_bytes": vm["total_bytes"], "languages": table, "sources": sources,
        "multipliers": {f"{lang}/{src}": round(m, 6) for (lang, src), m in sorted(mult.items())},
        "recency": recency,
    })
    return stats
