"""The ``tokenize`` stage: encode, split train/val, mix, and pack into fixed-length token shards.

Two passes:

1. **Encode** (per input shard, in parallel, cached per shard with ``ctx.cached_map``): every document
   is encoded with the bare ``tokenizers`` library (special-token strings in text stay plain text),
   followed by EOS (and preceded by BOS when ``add_bos``). Each document is assigned a split by a hash
   of ``parent_id or id`` (plus ``split_salt``): a document is in ``val`` when that hash falls below
   ``val_fraction`` and it has no parent. A child (augmented document) of a validation document is
   dropped (``child_of_val``), and a child of a training document is in ``train``: no augmented
   document and no relative of a validation document ever trains. The split of an original document
   depends only on its id, so it is stable when a refresh adds shards. Documents with fewer than
   ``min_tokens`` tokens are dropped (``too_short``); longer than ``max_tokens`` are split into
   pieces (each ending with EOS) or truncated (``long_docs``).
2. **Mix and pack** (one pass over the encoded shards): train segments are up- or down-sampled by
   ``language_weights`` x ``source_weights`` (or to the target ``language_shares``) with
   deterministic error diffusion in hash order, so every language gets its token target within one
   document's length. Copies are emitted in rounds (all first copies, then all second copies, ...),
   never next to each other. Validation is never mixed: it keeps the corpus' natural distribution.

Artifact layout (``<dir>``)::

    index.json          {"format": "llmpipe-packed/1", "seq_len", "dtype", "vocab_size", "eos_id",
                         "bos_id", "pad_id", "languages": [...], "splits": {"train"|"val":
                         {"sequences", "tokens", "shards": [{"file", "sequences", "tokens"}]}}}
    train-00000.bin     raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    val-00000.bin
    val-00000.lang.npy  uint8 per token: index into index["languages"]; 255 marks padding
    val_meta.json       {"languages", "per_language": {lang: {"docs", "bytes", "tokens"}},
                         "total_docs", "total_bytes", "total_tokens"}

A shard with ``n`` sequences holds ``n * seq_len + 1`` ids; sequence ``i`` is
``ids[i*seq_len : i*seq_len + seq_len + 1]`` (input = first ``seq_len``, target = last ``seq_len``),
so every token but a shard's first is a target exactly once. Only the first ``tokens`` ids of a shard
are real; the tail of the last shard of a split is padded with ``pad_id``. ``val_meta.json`` gives
the UTF-8 bytes behind the validation tokens (EOS included in ``tokens``): bits per byte =
sum of target NLL (nats) / ln 2 / total_bytes, per language with the ``.lang.npy`` arrays.
Read it with :class:`llmpipe.tokenization.dataset.PackedDataset`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.curation.augment.stage import input_shard_digest
from llmpipe.document import iter_documents, shard_paths
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json
from llmpipe.tokenization.config import TokenizeConfig
from llmpipe.tokenization.tokenizer import load_for_encoding

VERSION = "1"
FORMAT = "llmpipe-packed/1"
TRAIN, VAL, DROPPED = 0, 1, 2
PAD_LANG = 255
# segment table columns (int64): token offset, token count, lang index, source index, split, bytes,
# mixing order, split group key (63-bit hash of parent_id or id), is-child flag
SEG_COLS = 9

_TOKENIZERS: dict[str, tuple[Any, Any, re.Pattern[str] | None, dict[str, Any]]] = {}


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
    """
    key, order = group_keys(cfg.split_salt, parent_id or doc_id)
    in_val = key < cfg.val_fraction * 2**63
    if parent_id:
        return (None if in_val else TRAIN), key, order_hash(doc_id)
    return (VAL if in_val else TRAIN), key, order


def _tokenizer(tok_dir: str) -> tuple[Any, Any, re.Pattern[str] | None, dict[str, Any]]:
    """(plain tokenizer, special-escaping tokenizer, special-token regex, metadata), once per process.

    Escaping special tokens costs ~8% of encoding time, so only documents that contain a special
    token's text go through the escaping tokenizer.
    """
    if tok_dir not in _TOKENIZERS:
        from tokenizers import Tokenizer

        escaping, meta = load_for_encoding(tok_dir)
        plain = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
        plain.no_truncation()
        plain.no_padding()
        specials = [t.content for t in plain.get_added_tokens_decoder().values() if t.special]
        pattern = re.compile("|".join(re.escape(x) for x in specials)) if specials else None
        _TOKENIZERS[tok_dir] = (plain, escaping, pattern, meta)
    return _TOKENIZERS[tok_dir]


def _batches(docs: Iterator[Any], size: int, max_chars: int) -> Iterator[list[Any]]:
    """Documents in lists of at most ``size`` documents or about ``max_chars`` characters."""
    batch: list[Any] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d.text)
        if len(batch) >= size or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_shard(arg: tuple[str, str, TokenizeConfig], out_dir: Path) -> dict[str, Any]:
    """Pass 1 for one input shard: ``tokens.bin``, ``segments.npy`` and ``shard.json`` in ``out_dir``."""
    path, tok_dir, cfg = arg
    tok, escaping, special_re, meta = _tokenizer(tok_dir)
    dtype = token_dtype(meta["vocab_size"])
    eos, bos = meta["eos_id"], meta.get("bos_id")
    if cfg.add_bos and bos is None:
        raise ValueError("tokenize.add_bos: the tokenizer has no bos token")
    langs: dict[str, int] = {}
    sources: dict[str, int] = {}
    dropped: dict[str, int] = defaultdict(int)
    flat: list[int] = []  # every kept id of the shard, in order (one numpy conversion at the end)
    segs: list[tuple[int, ...]] = []
    counts = {"docs": 0, "truncated": 0, "split_docs": 0}
    head = [bos] if cfg.add_bos else []

    max_tokens, min_tokens, truncate = cfg.max_tokens, cfg.min_tokens, cfg.long_docs == "truncate"

    def encode(texts: list[str]) -> list[Any]:
        # encode_batch (not encode_batch_fast): measured faster here, and it keeps offsets for truncation
        encs = tok.encode_batch(texts, add_special_tokens=False)
        if special_re is not None:
            search = special_re.search
            for i, t in enumerate(texts):
                if search(t):  # rare: a special token's text inside a document
                    encs[i] = escaping.encode(t, add_special_tokens=False)
        return encs

    def consume(batch: list[Any], encs: list[Any]) -> None:
        for d, e in zip(batch, encs, strict=True):
            parent = d.metadata.get("parent_id")
            split, gkey, oh = assign_split(d.id, parent, cfg)
            if split is None:
                dropped["child_of_val"] += 1
                continue
            ids = e.ids
            n = len(ids)
            if n < min_tokens:
                dropped["too_short"] += 1
                continue
            text = d.text
            n_bytes = len(text.encode("utf-8"))
            chunks = (ids,)
            if max_tokens is not None and n > max_tokens:
                if truncate:
                    n_bytes = len(text[: e.offsets[max_tokens - 1][1]].encode("utf-8"))
                    chunks = (ids[:max_tokens],)
                    counts["truncated"] += 1
                else:
                    chunks = tuple(ids[i : i + max_tokens] for i in range(0, n, max_tokens))
                    counts["split_docs"] += 1
            li = langs.setdefault(str(d.metadata.get("lang") or "und"), len(langs))
            si = sources.setdefault(d.source, len(sources))
            child = 1 if parent else 0
            for ci, chunk in enumerate(chunks):
                start = len(flat)
                flat.extend(head)
                flat.extend(chunk)
                flat.append(eos)
                # bytes are attributed to the first piece (bits-per-byte sums over the split)
                segs.append((start, len(flat) - start, li, si, split, n_bytes if ci == 0 else 0, oh + ci, gkey,
                             child))

    gc_was_on = gc.isenabled()
    gc.disable()  # millions of small allocations and no cycles: the collector only costs time here
    try:
        # encode_batch releases the GIL: encode batch k+1 in a thread while Python consumes batch k
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: tuple[list[Any], Future[list[Any]]] | None = None
            for batch in _batches(iter_documents(path), cfg.batch_size, cfg.batch_chars):
                counts["docs"] += len(batch)
                fut = pool.submit(encode, [d.text for d in batch])
                if pending is not None:
                    consume(pending[0], pending[1].result())
                pending = (batch, fut)
            if pending is not None:
                consume(pending[0], pending[1].result())
    finally:
        if gc_was_on:
            gc.enable()
    tokens = np.asarray(flat, dtype=dtype)
    tokens.tofile(out_dir / "tokens.bin")
    np.save(out_dir / "segments.npy", np.asarray(segs, dtype=np.int64).reshape(-1, SEG_COLS))
    info = {"languages": list(langs), "sources": list(sources), "dtype": dtype.name}
    (out_dir / "shard.json").write_text(json.dumps(info, sort_keys=True))
    kept = counts["docs"] - sum(dropped.values())
    return {**counts, "kept": kept, "dropped": dict(dropped), "tokens": int(tokens.size)}


# -- pass 2: mixing ---------------------------------------------------------------------------------

def mixing_multipliers(train_tokens: dict[tuple[str, str], int], cfg: TokenizeConfig) -> dict[tuple[str, str], float]:
    """Sampling factor per (language, source) group of the train split."""
    mult = {g: cfg.language_weights.get(g[0], 1.0) * cfg.source_weights.get(g[1], 1.0) for g in train_tokens}
    if not cfg.language_shares:
        return mult
    weighted: dict[str, float] = defaultdict(float)
    for g, t in train_tokens.items():
        weighted[g[0]] += t * mult[g]
    missing = [lang for lang, s in cfg.language_shares.items() if s > 0 and weighted.get(lang, 0) <= 0]
    if missing:
        raise ValueError(f"tokenize.language_shares: languages {missing} have a share but no train tokens "
                         f"(present: {sorted(weighted)})")
    total = sum(weighted.values())
    lang_m = {lang: cfg.language_shares.get(lang, 0.0) * total / w for lang, w in weighted.items() if w > 0}
    return {g: m * lang_m.get(g[0], 0.0) for g, m in mult.items()}


def copies_by_error_diffusion(lengths: np.ndarray, multiplier: float) -> np.ndarray:
    """Copies per segment so the group's emitted tokens track ``multiplier`` x its tokens (error < 1 doc)."""
    out = np.zeros(len(lengths), dtype=np.int64)
    if multiplier == 1.0:
        out[:] = 1
        return out
    acc = 0.0
    for i, t in enumerate(lengths.tolist()):
        acc += multiplier * t
        k = max(0, math.floor(acc / t + 0.5))
        out[i] = k
        acc -= k * t
    return out


# -- pass 2: packing --------------------------------------------------------------------------------

class Packer:
    """Stream token arrays into fixed-length sequence shards (``<split>-NNNNN.bin``)."""

    def __init__(self, out: Path, split: str, seq_len: int, per_shard: int, dtype: np.dtype, pad_id: int,
                 with_lang: bool = False) -> None:
        self.out, self.split, self.L, self.S = out, split, seq_len, per_shard
        self.dtype, self.pad_id, self.with_lang = dtype, pad_id, with_lang
        self.buf: list[np.ndarray] = []
        self.lbuf: list[np.ndarray] = []
        self.n = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, tokens: np.ndarray, langs: np.ndarray | None = None) -> None:
        if tokens.size == 0:
            return
        self.buf.append(tokens)
        if self.with_lang:
            assert langs is not None
            self.lbuf.append(langs)
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
    """Concatenate ``arr[s : s + n]`` for each (s, n) without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return arr[:0]
    ends = np.cumsum(lengths)
    idx = np.arange(total) - np.repeat(ends - lengths, lengths) + np.repeat(starts, lengths)
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
        shards.append({"dir": d, "segs": segs, "dtype": info["dtype"]})
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


def plan_copies(shards: list[dict[str, Any]], langs: list[str], sources: list[str],
                cfg: TokenizeConfig) -> tuple[list[np.ndarray], dict[tuple[str, str], float]]:
    """Copies per train segment (per shard), from the mixing multipliers by error diffusion."""
    all_segs = np.concatenate([s["segs"] for s in shards]) if shards else np.zeros((0, SEG_COLS), np.int64)
    shard_of = np.concatenate([np.full(len(s["segs"]), i) for i, s in enumerate(shards)]) if shards else \
        np.zeros(0, np.int64)
    row_of = np.concatenate([np.arange(len(s["segs"])) for s in shards]) if shards else np.zeros(0, np.int64)
    train = all_segs[:, 4] == TRAIN
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for li, si, n in zip(all_segs[train, 2].tolist(), all_segs[train, 3].tolist(), all_segs[train, 1].tolist(),
                         strict=True):
        groups[(langs[li], sources[si])] += n
    mult = mixing_multipliers(dict(groups), cfg)
    copies = [np.zeros(len(s["segs"]), dtype=np.int64) for s in shards]
    for (lang, src), m in sorted(mult.items()):
        sel = np.nonzero(train & (all_segs[:, 2] == langs.index(lang)) & (all_segs[:, 3] == sources.index(src)))[0]
        order = sel[np.lexsort((row_of[sel], shard_of[sel], all_segs[sel, 6]))]
        k = copies_by_error_diffusion(all_segs[order, 1], m)
        for i, c in zip(order.tolist(), k.tolist(), strict=True):
            copies[shard_of[i]][row_of[i]] = c
    return copies, mult


def pack(shards: list[dict[str, Any]], copies: list[np.ndarray], out: Path, cfg: TokenizeConfig,
         meta: dict[str, Any]) -> dict[str, Any]:
    """Write the train and val sequence shards; returns the per-split index entries."""
    dtype = token_dtype(meta["vocab_size"])
    train = Packer(out, "train", cfg.seq_len, cfg.sequences_per_shard, dtype, meta["pad_id"])
    val = Packer(out, "val", cfg.seq_len, cfg.sequences_per_shard, dtype, meta["pad_id"], with_lang=True)
    rounds = max((int(c.max()) for c in copies if len(c)), default=0)
    for s in shards:  # validation: one copy, with its language per token
        segs = s["segs"]
        if not len(segs):
            continue
        toks = np.fromfile(s["dir"] / "tokens.bin", dtype=s["dtype"]).astype(dtype, copy=False)
        v = segs[:, 4] == VAL
        val.add(gather(toks, segs[v, 0], segs[v, 1]),
                np.repeat(segs[v, 2].astype(np.uint8), segs[v, 1]))
    for r in range(rounds):
        for s, c in zip(shards, copies, strict=True):
            segs = s["segs"]
            take = c > r
            if not take.any():
                continue
            toks = np.fromfile(s["dir"] / "tokens.bin", dtype=s["dtype"]).astype(dtype, copy=False)
            train.add(gather(toks, segs[take, 0], segs[take, 1]))
    return {"train": train.close(), "val": val.close()}


def _language_table(shards: list[dict[str, Any]], copies: list[np.ndarray], langs: list[str],
                    cfg: TokenizeConfig) -> list[dict[str, Any]]:
    before: dict[str, int] = defaultdict(int)
    after: dict[str, int] = defaultdict(int)
    val: dict[str, int] = defaultdict(int)
    for s, c in zip(shards, copies, strict=True):
        for row, k in zip(s["segs"].tolist(), c.tolist(), strict=True):
            lang = langs[row[2]]
            if row[4] == TRAIN:
                before[lang] += row[1]
                after[lang] += row[1] * k
            elif row[4] == VAL:
                val[lang] += row[1]
    tb, ta = sum(before.values()) or 1, sum(after.values()) or 1
    return [{"lang": lang, "train_tokens_before": before[lang], "train_tokens_after": after[lang],
             "share_before": round(before[lang] / tb, 4), "share_after": round(after[lang] / ta, 4),
             "target_share": cfg.language_shares.get(lang) if cfg.language_shares else None,
             "val_tokens": val[lang]} for lang in langs]


def _val_meta(shards: list[dict[str, Any]], langs: list[str]) -> dict[str, Any]:
    per: dict[str, dict[str, int]] = {lang: {"docs": 0, "bytes": 0, "tokens": 0} for lang in langs}
    for s in shards:
        for row in s["segs"].tolist():
            if row[4] != VAL:
                continue
            p = per[langs[row[2]]]
            p["docs"] += 1 if row[5] > 0 else 0
            p["bytes"] += row[5]
            p["tokens"] += row[1]
    per = {k: v for k, v in per.items() if v["tokens"]}
    return {"languages": langs, "per_language": per,
            "total_docs": sum(v["docs"] for v in per.values()),
            "total_bytes": sum(v["bytes"] for v in per.values()),
            "total_tokens": sum(v["tokens"] for v in per.values())}


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


@stage("tokenize", version=VERSION, inputs=("augment", "tokenizer"), config_field="tokenize", flow="data_refresh")
def run_tokenize(ctx: StageContext) -> dict[str, Any]:
    """Encode documents, split train/val by document hash, mix, and pack fixed-length token shards."""
    cfg: TokenizeConfig = ctx.config
    src, tok_dir = ctx.inputs["augment"], ctx.inputs["tokenizer"]
    meta = json.loads((Path(tok_dir) / "llmpipe_tokenizer.json").read_text())
    enc_cfg = {k: v for k, v in cfg.key_dict().items()
               if k in ("val_fraction", "split_salt", "min_tokens", "max_tokens", "long_docs", "add_bos")}
    tok_key = ctx.input_keys.get("tokenizer", "")
    items = [(hash_json(["tokenize-encode", VERSION, enc_cfg, tok_key, input_shard_digest(src, p)]),
              (str(p), str(tok_dir), cfg)) for p in shard_paths(src)]
    results = ctx.cached_map(encode_shard, items, desc="encode")
    shards, langs, sources = _load_shards(results)
    moved_children = ensure_min_val(shards, cfg)
    copies, mult = plan_copies(shards, langs, sources, cfg)
    splits = pack(shards, copies, ctx.out, cfg, meta)
    index = {"format": FORMAT, "seq_len": cfg.seq_len, "dtype": token_dtype(meta["vocab_size"]).name,
             "vocab_size": meta["vocab_size"], "eos_id": meta["eos_id"], "bos_id": meta.get("bos_id"),
             "pad_id": meta["pad_id"], "languages": langs, "splits": splits}
    (ctx.out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    vm = _val_meta(shards, langs)
    (ctx.out / "val_meta.json").write_text(json.dumps(vm, indent=1, sort_keys=True))
    table = _language_table(shards, copies, langs, cfg)
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
    })
    return stats
