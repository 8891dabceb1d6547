"""The ``dedup`` stage: signatures per shard in parallel, then exact + LSH decisions, then filter.

Artifact layout (under the stage's output directory):

- ``shards/<name>.parquet`` kept documents (text and metadata, as the input shard had them; an input
  shard that loses no document is hard-linked, not rewritten), ``rejected/<name>.parquet`` removed
  ones with ``metadata["reject_reason"]`` (``exact_duplicate`` / ``near_duplicate``) and
  ``duplicate_of``;
- ``index/meta.json`` (parameters + the ordered input shards with their sha256),
  ``index/shards/<stem>/{sig.npy,docs.parquet}`` per-shard signatures and decisions,
  ``index/lsh.json`` (datasketch storage / Redis basename; a refresh rebuilds the memory backend's
  buckets of the old documents that share a band key with a new one from the signatures, so it
  writes the same bytes as a cold run of the same key),
  ``index/bands/<stem>/{keys.npy,docs.npy}`` (external backend's sorted band records);
- ``funnel.json`` and ``funnel.png`` (:mod:`llmpipe.curation.funnel`; rejected reasons
  ``exact_duplicate`` / ``near_duplicate``).

A refresh finds the previous dedup artifact whose input shards are a prefix of this run's (same
names, same sha256, same key config), links its per-shard files, and decides only the new shards'
documents against the persisted index (see :mod:`llmpipe.curation.dedup.core` for the rule).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.curation.dedup.text import exact_hash, normalize, shingles
from llmpipe.curation.funnel import report_funnel
from llmpipe.document import (
    REJECTED,
    SHARDS,
    input_shards,
    iter_documents,
    numpy_array,
    read_columns,
    rejected_paths,
    shard_paths,
    string_array,
    write_shard,
)
from llmpipe.files import link_file
from llmpipe.lazy import lazy_import
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json

# numpy, pyarrow, numba (minhash) and datasketch (lsh) load when the stage runs, not when it registers
np = lazy_import("numpy")
pa = lazy_import("pyarrow")
pq = lazy_import("pyarrow.parquet")
core = lazy_import("llmpipe.curation.dedup.core")

# 2: an empty kept shard has no row group (`datasets` reads it); unchanged shards linked
# 3: the shared funnel (funnel.json in the filter stages' schema, funnel.png)
# 4: candidates are edges to each bucket's anchor; near duplicates verified by exact Jaccard vs the keeper
# 5: one definition of unspaced scripts with quality and safety (llmpipe.curation.text): lzh, Bopomofo, Han ext. G+
VERSION = "5"
WRITE_WINDOW = 16  # input shards whose decisions the driver holds at once while writing the outputs
INDEX_FORMAT = 3  # 2: memory index as base + deltas; 3: memory index rebuilt from the shards' signatures


# -- per-shard work (runs in worker processes) --------------------------------------------------------

@dataclass(frozen=True)
class SignatureJob:
    """One shard job of the signature pass: the MinHash signatures and exact hashes of one input
    shard's documents, with the stage's shingling settings (``minhash_backend`` picks the kernel,
    which does not change a value, so it is left out of the shard key)."""

    path: str  # the input shard
    num_perm: int
    seed: int
    word_ngram: int  # shingle size in words for spaced scripts
    char_ngram: int  # shingle size in characters for CJK / Thai-like scripts
    char_script_ratio: float
    minhash_backend: str  # auto | numba | numpy

    def shard_key(self, sha256: str) -> str:
        """The cache key of this job's result for an input shard of that content."""
        return hash_json(["dedup-sig", VERSION, self.num_perm, self.seed, self.word_ngram, self.char_ngram,
                          self.char_script_ratio, sha256])


@dataclass(frozen=True)
class SplitJob:
    """One job of the final pass: split one input shard into kept and rejected files by its decisions."""

    src: str  # the input shard
    out_root: str  # the stage's output directory
    name: str  # the shard's file name, the same under shards/ and rejected/
    status: np.ndarray  # per row: core.KEPT, core.EXACT or core.NEAR
    keeper_ids: list[str | None]  # per row: the id of the document a duplicate was removed for


def shard_signatures(job: SignatureJob, out_dir: Path) -> dict[str, Any]:
    """One input shard -> sig.npy (n x num_perm uint32), exact.npy (uint64), ids.parquet."""
    from llmpipe.curation.dedup.minhash import encode, signatures_encoded

    ids: list[str] = []
    hashes: list[int] = []
    sigs: list[np.ndarray] = []
    batch_texts: list[str] = []
    batch_langs: list[str | None] = []

    def flush() -> None:
        if batch_texts:
            enc = encode(batch_texts, batch_langs, char_ratio=job.char_script_ratio, normalized=True)
            sigs.append(signatures_encoded(enc, num_perm=job.num_perm, seed=job.seed, word_ngram=job.word_ngram,
                                           char_ngram=job.char_ngram, backend=job.minhash_backend))
            batch_texts.clear()
            batch_langs.clear()

    for doc in iter_documents(job.path):
        norm = normalize(doc.text)
        ids.append(doc.id)
        hashes.append(exact_hash(norm))
        batch_texts.append(norm)
        lang = doc.metadata.get("lang")
        batch_langs.append(lang if isinstance(lang, str) else None)
        if len(batch_texts) >= 2048:
            flush()
    flush()
    sig = np.concatenate(sigs) if sigs else np.zeros((0, job.num_perm), np.uint32)
    np.save(out_dir / "sig.npy", sig)
    np.save(out_dir / "exact.npy", np.array(hashes, dtype=np.uint64))
    pq.write_table(pa.table({"id": string_array(ids)}), out_dir / "ids.parquet")
    return {"docs": len(ids)}


def write_filtered(job: SplitJob) -> dict[str, int]:
    """Split one input shard into kept / rejected files by its decisions.

    A shard that loses no document is the input file itself (a hard link: no bytes written).
    """
    src, out_root, name, status = job.src, job.out_root, job.name, job.status
    if not (status != core.KEPT).any():
        link_file(Path(src), Path(out_root) / SHARDS / name)
        return {"kept": len(status), "rejected": 0}
    kept, rejected = [], []
    for row, doc in enumerate(iter_documents(src)):
        s = int(status[row])
        if s == core.KEPT:
            kept.append(doc)
        else:
            doc.metadata["reject_reason"] = core.REASONS[s]
            doc.metadata["duplicate_of"] = job.keeper_ids[row]
            rejected.append(doc)
    write_shard(Path(out_root) / SHARDS / name, kept)
    write_shard(Path(out_root) / REJECTED / name, rejected)
    return {"kept": len(kept), "rejected": len(rejected)}


# -- helpers --------------------------------------------------------------------------------------------

def _params(cfg: Any) -> dict[str, Any]:
    from llmpipe.curation.dedup.lsh import lsh_params

    bands, rows = lsh_params(cfg.threshold, cfg.num_perm, cfg.bands, cfg.rows,
                             cfg.false_positive_weight, cfg.false_negative_weight)
    # the stage version too: a refresh never links shards or decisions an older version wrote
    return {**cfg.key_dict(), "bands": bands, "rows": rows, "index_format": INDEX_FORMAT, "version": VERSION}


def find_previous(ctx: StageContext, params: dict[str, Any], shards: list[dict[str, Any]]) -> tuple[Path, dict] | None:
    """The earlier dedup artifact with the same params whose shards are the longest prefix of ours."""
    if not getattr(ctx.config, "incremental", True) or ctx.store is None:
        return None
    best: tuple[Path, dict] | None = None
    for st, key, _mf in ctx.store.artifacts():
        if st != ctx.name or key == ctx.key:
            continue
        art = ctx.store.get(st, key)
        meta_path = art.path / "index" / "meta.json" if art else None
        if meta_path is None or not meta_path.is_file():
            continue
        meta = json.loads(meta_path.read_text())
        if meta.get("params") != params:
            continue
        old = [(s["name"], s["sha256"]) for s in meta["shards"]]
        if not old or len(old) > len(shards) or old != [(s["name"], s["sha256"]) for s in shards[: len(old)]]:
            continue
        if best is None or len(old) > len(best[1]["shards"]):
            best = (art.path, meta)
    return best


class _Clock:
    """Wall and driver-CPU seconds per phase (the stats' ``seconds`` and ``cpu_seconds``): the CPU
    figure is what a growth test or benchmark can compare on a machine shared with other jobs."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._t, self._c = time.perf_counter(), time.process_time()

    def lap(self, phase: str) -> None:
        """Close ``phase`` (it began where the previous one ended) and start the next."""
        t, c = time.perf_counter(), time.process_time()
        self.wall[phase], self.cpu[phase] = round(t - self._t, 3), round(c - self._c, 3)
        self._t, self._c = t, c


class _Ids:
    """Document ids by global index, read per shard.

    :meth:`table` takes every keeper the removed documents name at once, sorted, so each shard
    holding one is read once per run (per output shard, with a cache of a few id columns, a keeper
    shard was read once per output shard that named it: output shards x keeper shards reads)."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.firsts: list[int] = []
        self.reads = 0  # id columns read (a test bounds them)

    def add(self, first: int, path: Path) -> None:
        self.files.append(path)
        self.firsts.append(first)

    def _column(self, k: int) -> tuple[np.ndarray, bytes]:
        """Shard ``k``'s ids as their UTF-8 bytes and offsets (what an Arrow string column holds)."""
        arr = read_columns(self.files[k], ["id"]).column("id").combine_chunks()
        width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
        offsets = np.frombuffer(arr.buffers()[1], width)[arr.offset : arr.offset + len(arr) + 1]
        data = arr.buffers()[2]
        self.reads += 1
        return offsets, data.to_pybytes() if data is not None else b""

    def table(self, idx: np.ndarray) -> _IdTable:
        """The ids of ``idx`` (distinct global indexes, ascending), each shard read once. Sliced from
        the column's buffers: Arrow's ``take`` would import ``pyarrow.compute`` (~0.05 CPU-seconds a run)."""
        idx = np.asarray(idx, np.int64)
        firsts = np.array(self.firsts, np.int64)
        which = np.searchsorted(firsts, idx, side="right") - 1
        lens = np.zeros(len(idx), np.int64)
        parts: list[bytes] = []
        for sel in np.split(np.arange(len(idx)), np.flatnonzero(np.diff(which)) + 1) if len(idx) else []:
            k = int(which[sel[0]])
            offsets, data = self._column(k)
            rows = idx[sel] - firsts[k]
            lo, hi = offsets[rows].astype(np.int64), offsets[rows + 1].astype(np.int64)
            lens[sel] = hi - lo
            parts.extend(data[x:y] for x, y in zip(lo.tolist(), hi.tolist(), strict=True))
        return _IdTable(idx, np.concatenate(([0], np.cumsum(lens))), b"".join(parts))


@dataclass(frozen=True)
class _IdTable:
    """Ids of some documents, compact: their UTF-8 bytes in one buffer (an id ~20 bytes, not a ~60-byte ``str``)."""

    docs: np.ndarray  # ascending global indexes
    offsets: np.ndarray  # id i: data[offsets[i] : offsets[i + 1]]
    data: bytes

    def get_many(self, idx: np.ndarray) -> list[str]:
        pos = np.searchsorted(self.docs, idx)
        lo, hi = self.offsets[pos].tolist(), self.offsets[pos + 1].tolist()
        return [self.data[a:b].decode("utf-8") for a, b in zip(lo, hi, strict=True)]


def _backend_index(cfg: Any, params: dict[str, Any], out_index: Path, prev: tuple[Path, dict] | None,
                   key: str) -> tuple[Any, bool]:
    """(index, loaded): the previous run's index when the backend keeps one (external runs linked into
    ``out_index/bands``, a Redis basename), else a fresh one that the stage fills from signatures."""
    from llmpipe.curation.dedup.lsh import DatasketchIndex, ExternalIndex

    b, r = params["bands"], params["rows"]
    if cfg.backend == "external":
        runs = [out_index / "bands" / Path(s["name"]).stem for s in (prev[1]["shards"] if prev else [])]
        if runs and all((d / "keys.npy").is_file() for d in runs):
            return ExternalIndex(runs, b, r, cfg.memory_budget_mb), True
        return ExternalIndex([], b, r, cfg.memory_budget_mb), False
    if cfg.backend == "memory":
        return DatasketchIndex.create(cfg.threshold, cfg.num_perm, (b, r), cfg.seed), False
    storage = {"type": "redis", "redis": {"host": cfg.redis.host, "port": cfg.redis.port, "db": cfg.redis.db}}
    if prev is not None:
        idx = DatasketchIndex.load_redis(prev[0] / "index", cfg.seed, storage, cfg.threshold, cfg.num_perm, (b, r))
        if idx is not None:
            return idx, True
    # a new lineage's buckets: under this artifact's key, which its refreshes keep using
    storage["basename"] = f"{cfg.redis.prefix}:{key[:16]}".encode()
    return DatasketchIndex.create(cfg.threshold, cfg.num_perm, (b, r), cfg.seed, storage), False


# -- the stage ------------------------------------------------------------------------------------------

@stage("dedup", version=VERSION, inputs=("entities",), config_field="dedup", flow="data_refresh",
       requires=lambda cfg: ("datasketch", "matplotlib", *(("redis",) if cfg.dedup.backend == "redis" else ())),
       extra="curation")
def run_dedup(ctx: StageContext) -> dict[str, Any]:
    """Exact + MinHash LSH near-dedup with a persistent, incremental index."""
    with tempfile.TemporaryDirectory(prefix=".tmp-dedup-", dir=ctx.out) as work:
        return _dedup(ctx, Path(work))


def _dedup(ctx: StageContext, work: Path) -> dict[str, Any]:
    """The stage; ``work``: its scratch folder (the exact-hash runs, per-shard decisions), removed after."""
    from llmpipe.curation.dedup.lsh import DatasketchIndex, ExternalIndex

    cfg = ctx.config
    clock = _Clock()
    params = _params(cfg)
    src = ctx.inputs["entities"]
    shards = [{"name": s.name, "sha256": s.sha256, "path": str(s.path)} for s in input_shards(src)]
    prev = find_previous(ctx, params, shards)
    n_old = len(prev[1]["shards"]) if prev else 0
    index_dir = ctx.out / "index"
    (index_dir / "shards").mkdir(parents=True, exist_ok=True)
    ctx.log.info("dedup: %d shards, %d reused from a previous index, bands=%d rows=%d backend=%s",
                 len(shards), n_old, params["bands"], params["rows"], cfg.backend)

    # 1. old shards: link decisions, signatures, outputs; register their segments
    sig_store = core.SigStore([])
    ids = _Ids()
    exact_index = core.ExactIndex(work / "exact")
    old_keeper_arr = _disk_array(work / "old-keepers.npy", sum(p["n"] for p in prev[1]["shards"]) if prev else 0)
    first = 0
    for k in range(n_old):
        s, ps = shards[k], prev[1]["shards"][k]
        stem = Path(s["name"]).stem
        for rel in (f"index/shards/{stem}/sig.npy", f"index/shards/{stem}/docs.parquet",
                    f"{SHARDS}/{s['name']}", f"{REJECTED}/{s['name']}",
                    f"index/bands/{stem}/keys.npy", f"index/bands/{stem}/docs.npy"):
            if (prev[0] / rel).is_file():
                link_file(prev[0] / rel, ctx.out / rel)
        sig_store.add(core.Segment(first, ps["n"], index_dir / "shards" / stem / "sig.npy"))
        ids.add(first, index_dir / "shards" / stem / "docs.parquet")
        t = read_columns(index_dir / "shards" / stem / "docs.parquet", ["exact_hash", "status", "keeper"])
        st = t.column("status").to_numpy()
        eh = t.column("exact_hash").to_numpy()
        uniq = np.flatnonzero(st != core.EXACT)
        exact_index.add_run(eh[uniq], first + uniq)
        old_keeper_arr[first : first + ps["n"]] = t.column("keeper").to_numpy()
        first += ps["n"]
    n_old_docs = first
    clock.lap("load_previous")

    # 2. signatures of the new shards, in parallel and cached per shard
    new = shards[n_old:]
    from llmpipe.curation.dedup.minhash import resolve_backend  # numpy: when the stage runs

    backend = resolve_backend(cfg.minhash_backend, _text_bytes([Path(s["path"]) for s in new]))
    jobs = [SignatureJob(path=s["path"], num_perm=params["num_perm"], seed=params["seed"],
                         word_ngram=params["word_ngram"], char_ngram=params["char_ngram"],
                         char_script_ratio=params["char_script_ratio"], minhash_backend=backend)
            for s in new]
    items = [(job.shard_key(s["sha256"]), job) for job, s in zip(jobs, new, strict=True)]
    sig_dirs = [d for d, _ in ctx.cached_map(shard_signatures, items, desc="signatures")]
    clock.lap("signatures")

    # 3. exact decisions, then LSH candidates over exact-unique new docs
    index, loaded = _backend_index(cfg, params, index_dir, prev, ctx.key)
    if cfg.near and n_old and not loaded:  # the memory index (or another backend's): rebuilt from signatures
        new_keys = _new_band_keys([d / "sig.npy" for d in sig_dirs], params) if cfg.backend == "memory" else None
        for k, seg in enumerate(sig_store.segments):
            stem = Path(shards[k]["name"]).stem
            uniq = np.flatnonzero(exact_index_mask(index_dir / "shards" / stem / "docs.parquet"))
            sigs = np.load(seg.path)[uniq]
            if new_keys is not None:
                mates = _bucket_mates(sigs, new_keys, params)
                index.bulk_insert(seg.first + uniq[mates], sigs[mates])
            else:
                _insert(index, index_dir / "bands" / stem, seg.first + uniq, sigs, query=False)
    per_shard: list[dict[str, Any]] = []
    edges: list[np.ndarray] = []  # memory / redis: at most `bands` edges per new document
    for s, d in zip(new, sig_dirs, strict=True):
        stem = Path(s["name"]).stem
        hashes = np.load(d / "exact.npy")
        n = len(hashes)
        target = exact_index.lookup_and_add(first, hashes) if cfg.exact else np.full(n, -1, np.int64)
        sig_store.add(core.Segment(first, n, d / "sig.npy"))
        ids.add(first, d / "ids.parquet")
        uniq = np.flatnonzero(target < 0)
        if cfg.near and len(uniq):
            got = _insert(index, index_dir / "bands" / stem, first + uniq, np.load(d / "sig.npy")[uniq], query=True)
            if got is not None and len(got):
                edges.append(got)
        np.save(work / f"target-{len(per_shard)}.npy", target)  # on disk till step 5: 8 bytes a doc
        per_shard.append({"shard": s, "stem": stem, "dir": d, "first": first, "n": n})
        first += n
    clock.lap("lsh")

    # 4. clusters: each new doc joins the first verified keeper among its anchors' keepers (core's rule)
    keeper_new = _disk_array(work / "keepers.npy", first - n_old_docs)  # by (global index - n_old_docs)
    for a in range(0, len(keeper_new), 1 << 20):  # each new document its own keeper, a chunk at a time
        keeper_new[a : a + (1 << 20)] = np.arange(n_old_docs + a, n_old_docs + min(a + (1 << 20), len(keeper_new)))
    texts = core.ShingleSets(lambda text, lang: shingles(
        text, word_ngram=params["word_ngram"], char_ngram=params["char_ngram"], lang=lang,
        char_ratio=params["char_script_ratio"]), work / "sets")
    start = 0
    for s, size in zip(shards, [p["n"] for p in (prev[1]["shards"] if prev else [])] + [p["n"] for p in per_shard],
                       strict=True):
        texts.add(start, Path(s["path"]))
        start += size
    with tempfile.TemporaryDirectory(prefix=".tmp-edges-", dir=ctx.out) as spill:
        if cfg.near and isinstance(index, ExternalIndex):
            stream = index.query_new(n_old_docs, first, Path(spill) / "query")
        else:
            stream = iter(edges)
        if cfg.verify:  # a pass to learn the documents the verification reads, each shard once, in order
            stream = _spill_and_build(stream, texts, Path(spill) / "edges.bin", n_old_docs, old_keeper_arr)
            edges.clear()  # on disk now
        n_edges = core.decide_near(stream, lambda i: int(old_keeper_arr[i]), keeper_new, n_old_docs,
                                   texts.jaccard if cfg.verify else None, cfg.threshold)
    texts.close()
    edges.clear()

    clock.lap("cluster")

    # 5. per-shard decisions (array operations, to scratch), the ids of every keeper they name (each
    # shard read once), then index files and filtered outputs, a window of shards at a time: the
    # driver holds one window's decisions (a byte and an id slot a document), not the corpus's
    named: list[np.ndarray] = []
    for k, ps in enumerate(per_shard):
        status, keeper = shard_decisions(np.load(work / f"target-{k}.npy"), ps["first"], n_old_docs,
                                         old_keeper_arr, keeper_new, cfg.near)
        np.save(work / f"status-{k}.npy", status)
        np.save(work / f"keeper-{k}.npy", keeper)
        named.append(np.unique(keeper[status != core.KEPT]))
    keeper_names = ids.table(np.unique(np.concatenate(named)) if named else np.zeros(0, np.int64))
    del named
    for w in range(0, len(per_shard), WRITE_WINDOW):
        splits = []
        for k in range(w, min(w + WRITE_WINDOW, len(per_shard))):
            ps = per_shard[k]
            status, keeper = np.load(work / f"status-{k}.npy"), np.load(work / f"keeper-{k}.npy")
            row_ids = read_columns(ps["dir"] / "ids.parquet").column("id").to_pylist()
            shard_index = index_dir / "shards" / ps["stem"]
            link_file(ps["dir"] / "sig.npy", shard_index / "sig.npy")
            pq.write_table(pa.table({"id": string_array(row_ids),
                                     "exact_hash": numpy_array(np.load(ps["dir"] / "exact.npy"), "uint64"),
                                     "status": numpy_array(status, "uint8"), "keeper": numpy_array(keeper, "int64")}),
                           shard_index / "docs.parquet")
            keeper_ids: list[str | None] = [None] * ps["n"]
            removed = np.flatnonzero(status != core.KEPT)
            for r, kid in zip(removed.tolist(), keeper_names.get_many(keeper[removed]), strict=True):
                keeper_ids[r] = kid
            splits.append(SplitJob(ps["shard"]["path"], str(ctx.out), ps["shard"]["name"], status, keeper_ids))
        ctx.map(write_filtered, splits)
    if isinstance(index, DatasketchIndex):
        index.save(index_dir)
        index.close()
    clock.lap("write")

    stats = _funnel(ctx, shards)
    stats.update({
        "shards": len(shards), "shards_reused": n_old, "new_docs": first - n_old_docs,
        "bands": params["bands"], "rows": params["rows"], "backend": cfg.backend,
        "lsh_inserts": index.inserts, "lsh_queries": index.queries, "edges_candidate": int(n_edges),
        "edges_verified": int(texts.computed), "verify_shard_reads": int(texts.reads),
        "id_shard_reads": int(ids.reads),
        "exact_run_reads": int(exact_index.run_reads), "exact_records_merged": int(exact_index.merged_records), "seconds": clock.wall, "cpu_seconds": clock.cpu,
    })
    sizes = [p["n"] for p in (prev[1]["shards"] if prev else [])] + [p["n"] for p in per_shard]
    meta = {"params": params, "backend": cfg.backend,
            "shards": [{"name": s["name"], "sha256": s["sha256"], "n": n} for s, n in zip(shards, sizes, strict=True)]}
    (index_dir / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return stats


def shard_decisions(target: np.ndarray, first: int, n_old_docs: int, old_keepers: np.ndarray,
                    new_keepers: np.ndarray, near: bool) -> tuple[np.ndarray, np.ndarray]:
    """(status, keeper) per row of the shard whose rows are the documents ``first ..``: an exact
    duplicate (``target`` >= 0: the earlier document with its text) takes that document's keeper,
    a near duplicate its cluster's keeper (``new_keepers``, by global index - ``n_old_docs``), every
    other row is kept as its own keeper. Array operations: a document costs no Python step."""
    n = len(target)
    status = np.zeros(n, np.uint8)
    keeper = np.arange(first, first + n, dtype=np.int64)
    exact = np.flatnonzero(target >= 0)
    if len(exact):
        tgt = target[exact]
        old = tgt < n_old_docs
        kp = np.empty(len(tgt), np.int64)
        kp[old] = old_keepers[tgt[old]]
        kp[~old] = new_keepers[tgt[~old] - n_old_docs]
        status[exact], keeper[exact] = core.EXACT, kp
    if near:
        own = np.asarray(new_keepers[first - n_old_docs : first - n_old_docs + n])
        moved = np.flatnonzero((target < 0) & (own != keeper))
        status[moved], keeper[moved] = core.NEAR, own[moved]
    return status, keeper


def _spill_and_build(stream: Any, texts: Any, path: Path, n_old_docs: int, old_keepers: np.ndarray) -> Any:
    """The edge stream spilled to ``path`` while the documents it can verify are collected; their
    shingle sets built (:meth:`core.ShingleSets.build`); the edges, read back in the same order."""
    spilled = core.EdgeSpill(path)
    want: list[np.ndarray] = []
    for chunk in stream:
        spilled.add(chunk)
        if len(chunk):
            want.append(core.needed(chunk, n_old_docs, lambda a: np.asarray(old_keepers[a], np.int64)))
    texts.build(np.unique(np.concatenate(want)) if want else np.zeros(0, np.int64))
    return iter(spilled)


def _new_band_keys(sig_paths: list[Path], params: dict[str, Any]) -> list[np.ndarray]:
    """Per band, the sorted distinct 64-bit keys (:func:`lsh.band_keys`) of the new shards' documents."""
    from llmpipe.curation.dedup.lsh import band_keys

    keys = [band_keys(np.load(p), params["bands"], params["rows"]) for p in sig_paths]
    every = np.concatenate(keys) if keys else np.zeros((0, params["bands"]), np.uint64)
    return [np.unique(every[:, b]) for b in range(params["bands"])]


def _bucket_mates(sigs: np.ndarray, new_keys: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    """Rows of ``sigs`` (old documents) sharing a band key with some new document.

    A refresh's in-memory index needs only these old documents: a new document's anchor is the
    smallest member of its bucket, and every old member of that bucket has the same band values,
    hence the same key. Inserting only them (a 64-bit key collision adds a harmless extra) gives
    every new document the anchors the whole rebuilt index gives, for a fraction of the inserts.
    """
    from llmpipe.curation.dedup.lsh import band_keys

    keys = band_keys(sigs, params["bands"], params["rows"])
    hit = np.zeros(len(sigs), bool)
    for b, nk in enumerate(new_keys):
        if len(nk):
            pos = np.minimum(np.searchsorted(nk, keys[:, b]), len(nk) - 1)
            hit |= nk[pos] == keys[:, b]
    return np.flatnonzero(hit)


def _text_bytes(paths: list[Path]) -> int:
    """The text column's bytes in these shards (from the Parquet footers: nothing is read)."""
    total = 0
    for p in paths:
        meta = pq.ParquetFile(p).metadata
        col = meta.schema.names.index("text")
        total += sum(meta.row_group(g).column(col).total_uncompressed_size for g in range(meta.num_row_groups))
    return total


def _disk_array(path: Path, n: int) -> np.ndarray:
    """An int64 array of ``n`` in a file (memory-mapped): the keeper arrays are 8 bytes a document,
    so they live on disk, and the page cache, not the process, holds what the decisions touch."""
    if n == 0:  # an empty file cannot be mapped
        return np.zeros(0, np.int64)
    return np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(n,))


def exact_index_mask(docs_parquet: Path) -> np.ndarray:
    """Rows of a shard's index that are exact-unique (the ones the LSH holds)."""
    return read_columns(docs_parquet, ["status"]).column("status").to_numpy() != core.EXACT


def _insert(index: Any, band_dir: Path, idx: np.ndarray, sigs: np.ndarray, query: bool) -> np.ndarray | None:
    """Add exact-unique docs to the LSH; for datasketch also return their (j, i<j) candidate pairs."""
    from llmpipe.curation.dedup.lsh import ExternalIndex

    if isinstance(index, ExternalIndex):
        index.write_run(band_dir, idx, sigs)
        return None
    got = index.add_and_query(idx, sigs, query=query)
    return got if query else None


def _funnel(ctx: StageContext, shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts from the written files (so they add up by construction of what is on disk), as stats."""
    kept = sum(pq.ParquetFile(p).metadata.num_rows for p in shard_paths(ctx.out))
    reasons: dict[str, int] = {}
    for p in rejected_paths(ctx.out):
        for doc in iter_documents(p):
            r = doc.metadata["reject_reason"]
            reasons[r] = reasons.get(r, 0) + 1
    docs_in = sum(pq.ParquetFile(s["path"]).metadata.num_rows for s in shards)
    after_exact = docs_in - reasons.get(core.REASONS[core.EXACT], 0)
    filters = {}  # the two decisions as the filter stages count theirs: documents in and out of each
    if ctx.config.exact:
        filters["exact"] = {"in": docs_in, "out": after_exact}
    if ctx.config.near:
        filters["near"] = {"in": after_exact, "out": kept}
    report_funnel(ctx, "dedup", {"in": docs_in, "kept": kept, "rejected": dict(sorted(reasons.items())),
                                 "filters": filters})
    return {"docs_in": docs_in, "kept": kept, **{f"rejected_{k}": v for k, v in reasons.items()}}
