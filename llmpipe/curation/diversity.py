"""Diversity: semantic clusters over the whole run, near-duplicates inside clusters, cluster caps.

NeMo Curator's semantic dedup, without a model: every document becomes a hashed TF-IDF vector of
its lowercase word 1- and 2-grams (CJK runs segmented into words first), sublinear term frequency,
IDF over the run, L2-normalized, in a sparse matrix. k-means (spherical, k-means++ seeding from
``seed``) clusters a count-sketch projection of those vectors (each feature added with a +-1 sign
into one of ``sketch_dims`` dense dimensions: inner products are preserved in expectation), and
inside each cluster the exact cosine of the sparse vectors decides: in corpus order, a document
whose cosine with an earlier *kept* document of its cluster reaches ``threshold`` is a
``semantic_duplicate`` of the earliest such document (kept documents are never removed later, as in
dedup). Reordered sentences and a few changed words keep a high cosine while they break most
MinHash shingles. Then ``max_cluster_share`` caps each cluster: the largest per-cluster count ``c``
with ``c <= share * sum(min(n_k, c))`` holds for the output, and a cluster's later documents over
``c`` are rejected as ``cluster_cap``.

With ``diversity.encoder`` (a sentence-embedding or encoder checkpoint by path), the documents'
mean-pooled encoder states replace the TF-IDF vectors for clustering and the duplicate step (the
cluster report's top terms still come from TF-IDF; the embeddings are held whole).

Memory: the run's TF-IDF rows are never stacked. IDF comes from a pass over the per-shard term
counts, the sketch is written part by part to a file that k-means reads in fixed blocks of
:data:`ROW_BLOCK` rows, and a second pass groups the rows by cluster on disk (:class:`ClusterRows`)
for the duplicate step and the top terms, one cluster at a time. Every operation is per row, or
adds rows in corpus order as the stacked computation did, so the decisions are those of the
in-memory version (checked on the test and benchmark corpora).

Time: the duplicate step compares every document with the earlier ones of its group, and a group
is a cluster of at most ``max_compared`` documents. A larger cluster is split for this step only
(:func:`compare_groups`: spherical k-means on a small count sketch of its rows, into groups of at
most that many, and runs in corpus order of whatever k-means cannot split, e.g. identical rows),
so the step costs at most ``n * max_compared`` cosines, not ``n^2 / clusters`` (2M documents in 16
clusters would be ~10^11). Clusters, caps and the report are unchanged by the split; a document's
``max_similarity`` is then over the earlier documents of its group. Below the bound nothing splits.

Feature hashing uses CRC-32 of the UTF-8 n-gram (never Python's salted ``hash``), so the same
documents give the same vectors, clusters and decisions in every process and run.
"""

from __future__ import annotations

import itertools
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from llmpipe.curation.scored import Decision
from llmpipe.document import iter_documents
from llmpipe.lazy import lazy_import

np = lazy_import("numpy")
sparse = lazy_import("scipy.sparse")
TF = "tf.npz"  # per shard, in the shard cache: term counts (CSR parts) of its documents
ROW_BLOCK = 4096  # rows of the sketch per k-means step (fixed: the labels must not depend on memory)
DUP_BLOCK = 2048  # rows of a cluster compared with the whole cluster at a time, at most
DUP_CELLS = 1 << 22  # ... and at most this many cosines at a time (32 MiB): a large cluster takes fewer rows
SPLIT_DIMS = 64  # the count sketch a cluster over ``max_compared`` documents is split in (8 bytes x 64 a row)


def ngrams(text: str, lang: str | None) -> list[str]:
    """Lowercase word unigrams and bigrams (punctuation dropped): the terms of a document."""
    from llmpipe.curation.text import words_of

    words = [w for w in words_of(text.lower(), lang) if w.isalnum() or any(c.isalnum() for c in w)]
    return words + [f"{a} {b}" for a, b in itertools.pairwise(words)]


class Hasher:
    """Term -> feature index (CRC-32 modulo ``features``), cached: a corpus repeats its terms."""

    def __init__(self, features: int) -> None:
        self.features = features
        self.cache: dict[str, int] = {}

    def __call__(self, term: str) -> int:
        i = self.cache.get(term)
        if i is None:
            i = zlib.crc32(term.encode("utf-8")) % self.features
            if len(self.cache) < 2_000_000:
                self.cache[term] = i
        return i


def term_counts(shard: str, features: int, default_lang: str, out_dir: Path) -> int:
    """One shard's documents as sparse term counts (``tf.npz``); returns the document count."""
    hasher = Hasher(features)
    indptr, indices, data = [0], [], []
    for doc in iter_documents(shard):
        lang = doc.metadata.get("lang") if isinstance(doc.metadata.get("lang"), str) else default_lang
        c: Counter[int] = Counter()
        for term, n in Counter(ngrams(doc.text, lang)).items():  # hash each distinct term once
            c[hasher(term)] += n
        keys = sorted(c)
        indices.extend(keys)
        data.extend(c[k] for k in keys)
        indptr.append(len(indices))
    np.savez(out_dir / TF, indptr=np.asarray(indptr, np.int64), indices=np.asarray(indices, np.int32),
             data=np.asarray(data, np.float32))
    return len(indptr) - 1


def idf_of(parts: Sequence[Path], features: int) -> tuple[Any, list[int]]:
    """IDF over the run (float32) and each part's document count, from one streaming pass over the
    parts' term counts: document frequencies are integer sums, so the same as over the stacked rows."""
    df = np.zeros(features, np.int64)
    sizes = []
    for p in parts:
        with np.load(p) as z:
            df += np.bincount(z["indices"], minlength=features)
            sizes.append(len(z["indptr"]) - 1)
    n = sum(sizes)
    return (np.log((1 + n) / (1 + df)) + 1).astype(np.float32), sizes


def tfidf_part(part: Path, idf: Any) -> Any:
    """One part's documents as L2-normalized TF-IDF rows (CSR, float32): every operation is per row,
    so a row's values are the same as in the whole run's stacked matrix."""
    with np.load(part) as z:
        x = sparse.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=(len(z["indptr"]) - 1, len(idf)))
    x.data = (1 + np.log(x.data)) * idf[x.indices]
    return _l2_rows(x)


def _l2_rows(x: Any) -> Any:
    norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
    norms[norms == 0] = 1.0
    return sparse.diags(1.0 / norms).astype(np.float32) @ x


def _count_sketch(features: int, dims: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    bucket = rng.integers(0, dims, size=features)
    sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=features)
    return sparse.csr_matrix((sign, (np.arange(features), bucket)), shape=(features, dims), dtype=np.float32)


def _sketch_rows(x: Any, s: Any) -> Any:
    y = np.asarray((x @ s).todense(), dtype=np.float64)
    norms = np.linalg.norm(y, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return y / norms


class RowFile:
    """Dense float64 rows on disk (raw, row after row), read in fixed blocks of :data:`ROW_BLOCK` rows.

    Why a file read with ``np.fromfile`` rather than a memory map: a mapped file's touched pages count
    in the process's resident memory until it is unmapped, a block read is freed after its step (the
    page cache holds the file for the next pass without charging the process).
    """

    def __init__(self, path: Path, dims: int) -> None:
        self.path, self.dims = path, dims
        self.n = path.stat().st_size // (8 * dims) if path.exists() else 0

    def __len__(self) -> int:
        return self.n

    def rows(self, start: int, stop: int) -> np.ndarray:
        count = max(0, min(stop, self.n) - start)
        return np.fromfile(self.path, np.float64, count * self.dims, offset=8 * self.dims * start).reshape(
            count, self.dims)

    def blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        for b0 in range(0, self.n, ROW_BLOCK):
            yield b0, self.rows(b0, b0 + ROW_BLOCK)


class RowArray(RowFile):
    """Dense rows in memory (the encoder's embeddings) behind :class:`RowFile`'s interface."""

    def __init__(self, y: np.ndarray) -> None:  # no file: rows(), blocks() read the array
        self.y, self.n, self.dims = y, len(y), y.shape[1] if y.ndim == 2 else 0

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.y[start:stop]


def sketch_to_file(parts: Sequence[Path], idf: Any, dims: int, seed: int, path: Path) -> RowFile:
    """The count sketch of every part's TF-IDF rows, appended part by part to ``path``: the parent
    holds one part's rows at a time."""
    s = _count_sketch(len(idf), dims, seed)
    with path.open("wb") as f:
        for p in parts:
            f.write(np.ascontiguousarray(_sketch_rows(tfidf_part(p, idf), s)).tobytes())
    return RowFile(path, dims)


def _dots(y: RowFile, v: np.ndarray) -> np.ndarray:
    return np.concatenate([b @ v for _, b in y.blocks()]) if len(y) else np.zeros(0)


def kmeans(y: np.ndarray | RowFile, k: int, iterations: int, seed: int) -> np.ndarray:
    """Spherical k-means labels (cosine), k-means++ seeding: the same labels for the same rows and seed.

    Every pass reads the rows in fixed blocks (:data:`ROW_BLOCK`, never sized by a memory budget, so
    the products and the labels do not depend on one); a center is the sum of its members added in
    row order, as a sum over the stacked rows adds them.
    """
    rows = y if isinstance(y, RowFile) else RowArray(y)
    n = len(rows)
    k = max(1, min(k, n))
    if n == 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng(seed)
    first = int(rng.integers(n))
    centers = [rows.rows(first, first + 1)[0]]
    dist = 1 - _dots(rows, centers[0])
    for _ in range(1, k):
        p = np.clip(dist, 0, None)
        idx = int(rng.choice(n, p=p / p.sum())) if p.sum() > 0 else int(rng.integers(n))
        centers.append(rows.rows(idx, idx + 1)[0])
        dist = np.minimum(dist, 1 - _dots(rows, centers[-1]))
    c = np.stack(centers)
    labels = np.zeros(n, np.int64)
    for it in range(iterations):
        new = np.zeros(n, np.int64)
        sums = np.zeros_like(c)
        for b0, b in rows.blocks():  # one pass: the labels, and the new centers' sums from them
            lb = np.argmax(b @ c.T, axis=1)
            new[b0:b0 + len(b)] = lb
            for j in np.unique(lb):  # the running sum, then this block's members, in row order
                sums[j] = np.add.reduce(np.concatenate([sums[j][None], b[lb == j]]), axis=0)
        if it and np.array_equal(new, labels):
            break
        labels = new
        counts = np.bincount(labels, minlength=k)
        for j in np.flatnonzero(counts):
            c[j] = sums[j] / (np.linalg.norm(sums[j]) or 1.0)
    return labels


def cluster_duplicates(xm: Any, members: np.ndarray, threshold: float | None, dup: np.ndarray,
                        best: np.ndarray, block: int) -> None:
    """One cluster's rows ``xm`` (rows ``members`` of the run, ascending): fill ``dup`` and ``best``."""
    kept = np.zeros(len(members), bool)
    block = max(1, min(block, DUP_CELLS // max(1, len(members))))  # a row's cosines do not depend on it
    xt = xm.T.tocsr()  # once per cluster, not once per block
    for b0 in range(0, len(members), block):
        sims = np.asarray((xm[b0:b0 + block] @ xt).todense())
        for r in range(sims.shape[0]):
            i = b0 + r
            row = sims[r, :i]
            best[members[i]] = float(row.max()) if i else 0.0
            hits = np.flatnonzero(kept[:i] & (row >= threshold)) if threshold is not None else []
            if len(hits):
                dup[members[i]] = members[hits[0]]
            else:
                kept[i] = True


def near_duplicates(x: Any, labels: np.ndarray, threshold: float | None, block: int = DUP_BLOCK,
                    max_compared: int | None = None, iterations: int = 25, seed: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(duplicate_of: the earliest kept doc of the same group with cosine >= threshold, else -1;
    max_similarity: the highest cosine with any earlier doc of the group), by global row index
    (every row in memory: the encoder's embeddings; the TF-IDF path goes through :class:`ClusterRows`).
    A group is a cluster, or a part of one over ``max_compared`` (:func:`bounded_duplicates`)."""
    n = x.shape[0]
    dup = np.full(n, -1, np.int64)
    best = np.zeros(n, np.float64)
    for j in np.unique(labels):
        members = np.flatnonzero(labels == j)  # ascending: corpus order
        bounded_duplicates(x[members], members, threshold, dup, best, block, max_compared, iterations, seed)
    return dup, best


def bounded_duplicates(xm: Any, members: np.ndarray, threshold: float | None, dup: np.ndarray, best: np.ndarray,
                       block: int, max_compared: int | None, iterations: int, seed: int) -> None:
    """:func:`cluster_duplicates` on each of the cluster's :func:`compare_groups` (the cluster itself
    when it has at most ``max_compared`` rows, or the bound is None)."""
    if max_compared is None or len(members) <= max_compared:
        cluster_duplicates(xm, members, threshold, dup, best, block)
        return
    y = _sketch_rows(xm, _count_sketch(xm.shape[1], SPLIT_DIMS, seed))
    for g in compare_groups(y, max_compared, iterations, seed):
        cluster_duplicates(xm[g], members[g], threshold, dup, best, block)


def compare_groups(y: np.ndarray, bound: int, iterations: int, seed: int) -> list[np.ndarray]:
    """A partition of the rows of ``y`` (unit rows) into groups of at most ``bound`` rows, each group's
    indexes ascending: spherical k-means into ``2 * ceil(m / bound)`` parts, each part over the bound
    split again the same way, and a part k-means leaves whole (its rows alike) cut into runs of
    ``bound`` rows in row order. The same rows and seed give the same groups."""
    m = len(y)
    if m <= bound:
        return [np.arange(m)]
    labels = kmeans(y, 2 * -(-m // bound), iterations, seed)
    parts = [np.flatnonzero(labels == j) for j in np.unique(labels)]
    if len(parts) == 1:  # k-means could not split it: runs in corpus order
        return [np.arange(a, min(a + bound, m)) for a in range(0, m, bound)]
    return [part[g] for part in parts for g in compare_groups(y[part], bound, iterations, seed)]


class ClusterRows:
    """The run's TF-IDF rows grouped by cluster on disk, in row order: one pass over the parts appends
    each part's rows of cluster ``j`` to ``j``'s files (row lengths, feature indexes, weights), then
    :meth:`load` reads one cluster at a time. The pass also sums every row (``overall``: the run's mean
    weight per feature, added in row order as ``x.mean(axis=0)`` adds them)."""

    def __init__(self, parts: Sequence[Path], idf: Any, labels: np.ndarray, folder: Path) -> None:
        self.folder, self.features, self.labels = folder, len(idf), labels
        folder.mkdir(parents=True, exist_ok=True)
        scale = 1.0 / len(labels) if len(labels) else 0.0
        self.overall = np.zeros(self.features, np.float32)
        start = 0
        for p in parts:
            x = tfidf_part(p, idf)
            np.add.at(self.overall, x.indices, x.data * scale)
            lab = labels[start:start + x.shape[0]]
            start += x.shape[0]
            for j in np.unique(lab):
                xj = x[np.flatnonzero(lab == j)]
                for ext, arr in (("len", np.diff(xj.indptr).astype(np.int64)), ("idx", xj.indices.astype(np.int32)),
                                 ("dat", xj.data.astype(np.float32))):
                    with (folder / f"{j}.{ext}").open("ab") as f:
                        f.write(arr.tobytes())

    def load(self, j: int) -> Any:
        """Cluster ``j``'s rows (CSR, in row order)."""
        lens = np.fromfile(self.folder / f"{j}.len", np.int64)
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        return sparse.csr_matrix((np.fromfile(self.folder / f"{j}.dat", np.float32),
                                  np.fromfile(self.folder / f"{j}.idx", np.int32), indptr),
                                 shape=(len(lens), self.features))

    def clusters(self) -> Iterator[tuple[int, np.ndarray, Any]]:
        """(cluster, its rows' indexes in the run, its rows) for every non-empty cluster, one at a time."""
        for j in np.unique(self.labels):
            yield int(j), np.flatnonzero(self.labels == j), self.load(int(j))


def distinctive(xm: Any, overall: np.ndarray, n_terms: int) -> list[int]:
    """A cluster's most distinctive features: mean TF-IDF weight in the cluster minus in the whole
    run (so words every cluster uses do not crowd out what sets this one apart), best first."""
    weight = np.asarray(xm.mean(axis=0)).ravel() - overall
    top = [int(i) for i in np.argpartition(-weight, min(n_terms, len(weight) - 1))[:n_terms] if weight[i] > 0]
    top.sort(key=lambda i: (-weight[i], i))
    return top


def name_terms(tops: Sequence[list[int]], labels: np.ndarray, texts_of: Any, features: int,
               default_lang: str, sample: int = 50) -> list[list[str]]:
    """Each cluster's top features named from a sample of its documents (feature hashing keeps no
    term strings): its first ``sample`` documents, read in one pass over the shards for every cluster."""
    hasher = Hasher(features)
    members = [np.flatnonzero(labels == j)[:sample] for j in range(len(tops))]
    rows = sorted({int(i) for m in members for i in m})
    texts = dict(zip(rows, texts_of(rows), strict=True))
    out = []
    for m, top in zip(members, tops, strict=True):
        names: dict[int, Counter[str]] = {i: Counter() for i in top}
        for i in m:
            text, lang = texts[int(i)]
            for t in ngrams(text, lang or default_lang):
                h = hasher(t)
                if h in names:
                    names[h][t] += 1
        out.append([names[i].most_common(1)[0][0] for i in top if names[i]])
    return out


def cluster_cap(sizes: Sequence[int], share: float) -> int:
    """The largest per-cluster count c with c <= share * sum(min(n_k, c)): after capping every
    cluster at c, none holds more than ``share`` of what is kept."""
    lo, hi = 0, max(sizes, default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid <= share * sum(min(s, mid) for s in sizes):
            lo = mid
        else:
            hi = mid - 1
    return lo


REASONS = (None, "semantic_duplicate", "cluster_cap")  # a document's reason code -> its reject reason


def decide(labels: np.ndarray, dup: np.ndarray, share: float | None) -> tuple[np.ndarray, int | None]:
    """Per document (global order) a reason code (:data:`REASONS`: kept, semantic duplicate, over the
    cap: one byte a document), and the cap applied."""
    codes = np.zeros(len(labels), np.int8)
    codes[dup >= 0] = 1
    cap = None
    if share is not None:
        alive = np.flatnonzero(dup < 0)
        sizes = np.bincount(labels[alive], minlength=int(labels.max()) + 1 if len(labels) else 0)
        nonempty = [int(s) for s in sizes if s]
        cap = cluster_cap(nonempty, share)
        if nonempty and cap == 0:
            raise ValueError(f"diversity.max_cluster_share: {share} x {len(nonempty)} non-empty clusters < 1: "
                             "no cap can hold; raise the share or the number of clusters")
        lab = labels[alive]
        order = np.argsort(lab, kind="stable")  # by cluster, corpus order inside each
        ranked = lab[order]
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order)) - np.searchsorted(ranked, ranked, side="left")
        codes[alive[rank >= cap]] = 2  # a cluster's documents after its first ``cap`` kept ones
    return codes, cap


class ShardDecisions:
    """One shard's decisions, made from its slice of the run's small arrays in the worker that writes
    the shard: the parent never holds a :class:`Decision` per document."""

    def __init__(self, labels: np.ndarray, best: np.ndarray, codes: np.ndarray, duplicate_of: dict[int, str]) -> None:
        self.labels, self.best, self.codes, self.duplicate_of = labels, best, codes, duplicate_of

    def __len__(self) -> int:
        return len(self.labels)

    def __iter__(self) -> Iterator[Decision]:
        for i in range(len(self.labels)):
            d = Decision(reason=REASONS[int(self.codes[i])],
                         scores={"cluster": int(self.labels[i]), "max_similarity": round(float(self.best[i]), 6)})
            if i in self.duplicate_of:
                d.meta["duplicate_of"] = self.duplicate_of[i]
            yield d


def embed(texts: Sequence[str], model_dir: str, max_length: int = 256, batch_size: int = 32,
          device: str = "cpu") -> Any:
    """Mean-pooled, L2-normalized token states of an encoder checkpoint (``AutoModel`` by path), as a
    sparse matrix so that clustering and the duplicate step take it like the TF-IDF vectors."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).to(device).eval()
    max_length = min(max_length, getattr(model.config, "max_position_embeddings", max_length) or max_length,
                     tok.model_max_length or max_length)  # never past what the encoder can read
    rows = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            enc = tok(list(texts[i:i + batch_size]), padding=True, truncation=True, max_length=max_length,
                      return_tensors="pt").to(device)
            states = model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].unsqueeze(-1).float()
            mean = (states * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            rows.append(torch.nn.functional.normalize(mean, dim=-1).cpu().numpy().astype(np.float64))
    dense = np.concatenate(rows) if rows else np.zeros((0, 1))
    return sparse.csr_matrix(dense)
