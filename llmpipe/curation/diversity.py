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
cluster report's top terms still come from TF-IDF).

Feature hashing uses CRC-32 of the UTF-8 n-gram (never Python's salted ``hash``), so the same
documents give the same vectors, clusters and decisions in every process and run.
"""

from __future__ import annotations

import itertools
import zlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmpipe.curation.scored import Decision
from llmpipe.document import iter_documents
from llmpipe.lazy import lazy_import

np = lazy_import("numpy")
sparse = lazy_import("scipy.sparse")
TF = "tf.npz"  # per shard, in the shard cache: term counts (CSR parts) of its documents


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


def tfidf(parts: Sequence[Path], features: int) -> Any:
    """The run's documents as L2-normalized TF-IDF rows (CSR, float32), in shard then row order."""
    mats = []
    for p in parts:
        z = np.load(p)
        mats.append(sparse.csr_matrix((z["data"], z["indices"], z["indptr"]),
                                      shape=(len(z["indptr"]) - 1, features)))
    x = sparse.vstack(mats, format="csr") if mats else sparse.csr_matrix((0, features), dtype=np.float32)
    n = x.shape[0]
    df = np.bincount(x.indices, minlength=features)
    idf = (np.log((1 + n) / (1 + df)) + 1).astype(np.float32)
    x.data = (1 + np.log(x.data)) * idf[x.indices]
    return _l2_rows(x)


def _l2_rows(x: Any) -> Any:
    norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
    norms[norms == 0] = 1.0
    return sparse.diags(1.0 / norms).astype(np.float32) @ x


def sketch(x: Any, dims: int, seed: int) -> np.ndarray:
    """Count-sketch projection of the sparse rows to ``dims`` dense dimensions, rows L2-normalized."""
    f = x.shape[1]
    rng = np.random.default_rng(seed)
    bucket = rng.integers(0, dims, size=f)
    sign = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=f)
    s = sparse.csr_matrix((sign, (np.arange(f), bucket)), shape=(f, dims), dtype=np.float32)
    y = np.asarray((x @ s).todense(), dtype=np.float64)
    norms = np.linalg.norm(y, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return y / norms


def kmeans(y: np.ndarray, k: int, iterations: int, seed: int) -> np.ndarray:
    """Spherical k-means labels (cosine), k-means++ seeding: the same labels for the same rows and seed."""
    n = len(y)
    k = max(1, min(k, n))
    if n == 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng(seed)
    centers = [y[int(rng.integers(n))]]
    dist = 1 - y @ centers[0]
    for _ in range(1, k):
        p = np.clip(dist, 0, None)
        idx = int(rng.choice(n, p=p / p.sum())) if p.sum() > 0 else int(rng.integers(n))
        centers.append(y[idx])
        dist = np.minimum(dist, 1 - y @ y[idx])
    c = np.stack(centers)
    labels = np.zeros(n, np.int64)
    for it in range(iterations):
        new = np.argmax(y @ c.T, axis=1)
        if it and np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            members = y[labels == j]
            if len(members):
                v = members.sum(axis=0)
                c[j] = v / (np.linalg.norm(v) or 1.0)
    return labels


def near_duplicates(x: Any, labels: np.ndarray, threshold: float | None, block: int = 2048
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(duplicate_of: the earliest kept doc of the same cluster with cosine >= threshold, else -1;
    max_similarity: the highest cosine with any earlier doc of the cluster), by global row index."""
    n = x.shape[0]
    dup = np.full(n, -1, np.int64)
    best = np.zeros(n, np.float64)
    for j in np.unique(labels):
        members = np.flatnonzero(labels == j)  # ascending: corpus order
        xm = x[members]
        kept = np.zeros(len(members), bool)
        for b0 in range(0, len(members), block):
            sims = np.asarray((xm[b0:b0 + block] @ xm.T).todense())
            for r in range(sims.shape[0]):
                i = b0 + r
                row = sims[r, :i]
                best[members[i]] = float(row.max()) if i else 0.0
                hits = np.flatnonzero(kept[:i] & (row >= threshold)) if threshold is not None else []
                if len(hits):
                    dup[members[i]] = members[hits[0]]
                else:
                    kept[i] = True
    return dup, best


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


def decide(labels: np.ndarray, dup: np.ndarray, best: np.ndarray, share: float | None,
           ids: Sequence[str]) -> tuple[list[Decision], int | None]:
    """Per document (global order): semantic duplicate, over the cap, or kept; and the cap applied."""
    out = [Decision(scores={"cluster": int(labels[i]), "max_similarity": round(float(best[i]), 6)})
           for i in range(len(labels))]
    for i in np.flatnonzero(dup >= 0):
        out[i].reason = "semantic_duplicate"
        out[i].meta["duplicate_of"] = ids[int(dup[i])]
    cap = None
    if share is not None:
        alive = np.flatnonzero(dup < 0)
        sizes = np.bincount(labels[alive], minlength=int(labels.max()) + 1 if len(labels) else 0)
        nonempty = [int(s) for s in sizes if s]
        cap = cluster_cap(nonempty, share)
        if nonempty and cap == 0:
            raise ValueError(f"diversity.max_cluster_share: {share} x {len(nonempty)} non-empty clusters < 1: "
                             "no cap can hold; raise the share or the number of clusters")
        taken: Counter[int] = Counter()
        for i in alive:
            c = int(labels[i])
            taken[c] += 1
            if taken[c] > cap:
                out[i].reason = "cluster_cap"
    return out, cap


def top_terms(x: Any, labels: np.ndarray, k: int, texts_of: Any, features: int, n_terms: int,
              default_lang: str, sample: int = 50) -> list[list[str]]:
    """Each cluster's most distinctive terms (mean TF-IDF weight in the cluster minus in the whole run,
    so words every cluster uses do not crowd out what sets this one apart), named from a sample of
    its documents (feature hashing keeps no term strings)."""
    if x.shape[0] == 0:
        return [[] for _ in range(k)]
    hasher = Hasher(features)
    overall = np.asarray(x.mean(axis=0)).ravel()
    members = [np.flatnonzero(labels == j) for j in range(k)]
    rows = sorted({int(i) for m in members for i in m[:sample]})
    texts = dict(zip(rows, texts_of(rows), strict=True))  # one pass over the shards for every cluster
    out = []
    for m in members:
        if not len(m):
            out.append([])
            continue
        weight = np.asarray(x[m].mean(axis=0)).ravel() - overall
        top = [int(i) for i in np.argpartition(-weight, min(n_terms, len(weight) - 1))[:n_terms] if weight[i] > 0]
        top.sort(key=lambda i: (-weight[i], i))
        names: dict[int, Counter[str]] = {i: Counter() for i in top}
        for i in m[:sample]:
            text, lang = texts[int(i)]
            for t in ngrams(text, lang or default_lang):
                h = hasher(t)
                if h in names:
                    names[h][t] += 1
        out.append([names[i].most_common(1)[0][0] for i in top if names[i]])
    return out


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
