"""Write an n-gram language model in the ARPA format from token sentences, without KenLM's tools.

The ``kenlm`` Python package reads ARPA (and KenLM binary) models but ships no estimator
(``lmplz``), so the coherence stage builds a model from a reference set itself: interpolated
Kneser-Ney with one absolute discount per order. The highest order uses raw counts, lower orders
continuation counts (the number of distinct words seen before an n-gram; n-grams that start with
``<s>`` keep raw counts, having no left context), and the unigram distribution is interpolated with
a uniform one over the vocabulary and ``<unk>``. In ARPA form a seen n-gram carries its interpolated
probability and each context the weight that interpolation gave to the order below, so KenLM's
backoff rule (``p(w|h) = b(h) p(w|h')`` for unseen ``hw``) reproduces the interpolated model exactly
and every conditional distribution sums to one. The output is sorted, so the same sentences give
the same bytes.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from pathlib import Path
from typing import Any

BOS, EOS, UNK = "<s>", "</s>", "<unk>"


def _counts(sentences: Iterable[Sequence[str]], order: int) -> list[Counter[tuple[str, ...]]]:
    counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order + 1)]
    for sent in sentences:
        toks = [BOS, *(t for t in sent if t not in (BOS, EOS, UNK)), EOS]
        for n in range(1, order + 1):
            for i in range(len(toks) - n + 1):
                counts[n][tuple(toks[i:i + n])] += 1
    return counts


def _adjusted(counts: list[Counter[tuple[str, ...]]], order: int) -> list[Counter[tuple[str, ...]]]:
    """Kneser-Ney counts: raw at the top order and for n-grams starting with <s>, continuation below."""
    adj: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order + 1)]
    adj[order] = Counter(counts[order])
    for n in range(1, order):
        for g in counts[n + 1]:
            adj[n][g[1:]] += 1
        for g, c in counts[n].items():
            if g[0] == BOS:
                adj[n][g] = c
    adj[1].pop((BOS,), None)
    return adj


def kneser_ney(sentences: Iterable[Sequence[str]], order: int = 3, discount: float = 0.75
               ) -> tuple[list[dict[tuple[str, ...], float]], list[dict[tuple[str, ...], float]]]:
    """(probabilities, backoff weights) per order (index 1..order), both as plain probabilities."""
    if order < 1:
        raise ValueError(f"n-gram order must be >= 1, got {order}")
    if not 0 < discount < 1:
        raise ValueError(f"discount must be in (0, 1), got {discount}")
    adj = _adjusted(_counts(sentences, order), order)
    if not adj[1]:
        raise ValueError("no tokens to estimate a language model from")
    tot: list[dict[tuple[str, ...], int]] = [{} for _ in range(order + 1)]
    types: list[dict[tuple[str, ...], int]] = [{} for _ in range(order + 1)]
    for n in range(1, order + 1):
        t, k = defaultdict(int), defaultdict(int)
        for g, c in adj[n].items():
            t[g[:-1]] += c
            k[g[:-1]] += 1
        tot[n], types[n] = dict(t), dict(k)
    prob: list[dict[tuple[str, ...], float]] = [{} for _ in range(order + 1)]
    vocab = sorted({g[0] for g in adj[1]})
    uniform = 1.0 / (len(vocab) + 1)  # + <unk>
    gamma0 = discount * types[1][()] / tot[1][()]
    for w in vocab:
        prob[1][(w,)] = max(adj[1][(w,)] - discount, 0.0) / tot[1][()] + gamma0 * uniform
    prob[1][(UNK,)] = gamma0 * uniform
    for n in range(2, order + 1):
        for g in sorted(adj[n]):
            h = g[:-1]
            gamma = discount * types[n][h] / tot[n][h]
            prob[n][g] = max(adj[n][g] - discount, 0.0) / tot[n][h] + gamma * prob[n - 1][g[1:]]
    backoff: list[dict[tuple[str, ...], float]] = [{} for _ in range(order + 1)]
    for n in range(1, order):
        for h, t in tot[n + 1].items():
            backoff[n][h] = discount * types[n + 1][h] / t
    return prob, backoff


def write_arpa(sentences: Iterable[Sequence[str]], path: str | Path, order: int = 3,
               discount: float = 0.75) -> Path:
    """Estimate an interpolated Kneser-Ney model of ``order`` from token sentences; write it as ARPA."""
    prob, backoff = kneser_ney(sentences, order, discount)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows_per_order = []
    for n in range(1, order + 1):
        rows = dict(prob[n])
        if n == 1:
            rows[(BOS,)] = 0.0  # <s> is never predicted: log10 p = -99 by convention
        rows_per_order.append(sorted(rows.items()))
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n\\data\\\n")
        for n, rows in enumerate(rows_per_order, 1):
            f.write(f"ngram {n}={len(rows)}\n")
        for n, rows in enumerate(rows_per_order, 1):
            f.write(f"\n\\{n}-grams:\n")
            for g, p in rows:
                lp = -99.0 if p <= 0.0 else math.log10(p)
                line = f"{lp:.7f}\t{' '.join(g)}"
                if n < order and g in backoff[n]:
                    line += f"\t{math.log10(backoff[n][g]):.7f}"
                f.write(line + "\n")
        f.write("\n\\end\\\n")
    return path


class ArpaModel:
    """An ARPA backoff model scored in Python: the coherence stage's scorer without the compiled ``kenlm``.

    ``score`` follows KenLM's ``Model.score(sentence, bos, eos)``: log10 of the sentence's probability,
    each word by the longest n-gram the model has (``p(w|h) = b(h) p(w|h')`` for an unseen ``hw``),
    unknown words as ``<unk>``. KenLM's compiled query is faster and also reads its binary format;
    ``tests/unit/curation/test_coherence.py`` pins that both give the same scores on ARPA files.

    Scoring goes through :class:`_NgramIndex` (integer n-gram ids in sorted arrays, a document's
    sentences in one vector pass per order) instead of a tuple of strings built and looked up per
    word and context length, which was three quarters of the coherence stage; the additions are the
    per-word ones in the same order, so the scores are the same floats (a test compares them with
    the per-word definition, :meth:`reference_score`).
    """

    def __init__(self, path: str | Path) -> None:
        self.prob: dict[tuple[str, ...], float] = {}
        self.backoff: dict[tuple[str, ...], float] = {}
        self.order = 0
        section = 0
        with open(path, encoding="utf-8") as f:
            for raw in f:
                line = raw.strip()
                if not line or line.startswith(("ngram ", "\\data\\", "\\end\\")):
                    continue
                if line.startswith("\\") and line.endswith("-grams:"):
                    section = int(line[1:].split("-")[0])
                    self.order = max(self.order, section)
                    continue
                parts = line.split("\t") if "\t" in line else line.split()
                gram = tuple(parts[1].split()) if "\t" in line else tuple(parts[1 : 1 + section])
                self.prob[gram] = float(parts[0])
                rest = parts[2:] if "\t" in line else parts[1 + section:]
                if rest:
                    self.backoff[gram] = float(rest[0])
        if (UNK,) not in self.prob:
            raise ValueError(f"{path}: an ARPA model needs a <unk> unigram")
        self.index = _NgramIndex(self.prob, self.backoff, self.order)

    def _word(self, context: tuple[str, ...], word: str) -> float:
        if (word,) not in self.prob:
            word = UNK
        for start in range(len(context) + 1):  # longest context first
            gram = (*context[start:], word)
            if gram in self.prob:
                return self.prob[gram] + sum(self.backoff.get(context[s:], 0.0) for s in range(start))
        raise AssertionError("unreachable: every word has a unigram")

    def reference_score(self, sentence: str, bos: bool = True, eos: bool = True) -> float:
        """:meth:`score` by the definition, one word and one dict lookup per context length at a time
        (what the tests compare the indexed scorer with)."""
        words = sentence.split()
        history = [BOS] if bos else []
        total = 0.0
        for w in [*words, *([EOS] if eos else [])]:
            total += self._word(tuple(history[-(self.order - 1):]) if self.order > 1 else (), w)
            history.append(w)
        return total

    def score(self, sentence: str, bos: bool = True, eos: bool = True) -> float:
        return self.score_lines([sentence], bos, eos)[0]

    def score_lines(self, sentences: Sequence[str], bos: bool = True, eos: bool = True) -> list[float]:
        """:meth:`score` of each sentence, all of them in one pass (a document's sentences)."""
        return self.index.score([s.split() for s in sentences], bos, eos)


class _NgramIndex:
    """Every n-gram of a model, and every prefix of one, as an integer node; an n-gram's node is found
    from its prefix's node and its last word by a binary search in one sorted int64 array per order.

    Words are nodes ``0 .. V-1`` (sorted); a longer n-gram's key is ``prefix node * V + last word``.
    A node carries its log10 probability (when the model lists the n-gram) and its backoff (0.0 when
    it lists none, as the per-word lookup's ``get(..., 0.0)``).
    """

    def __init__(self, prob: dict[tuple[str, ...], float], backoff: dict[tuple[str, ...], float], order: int) -> None:
        import numpy as np

        grams = [*prob, *(g for g in backoff if g not in prob)]
        words = sorted({w for g in grams for w in g})
        self.vocab = {w: i for i, w in enumerate(words)}
        v = self.n_words = len(words)
        node: dict[tuple[str, ...], int] = {(w,): i for i, w in enumerate(words)}
        keys: list[list[int]] = [[] for _ in range(order + 1)]
        ids: list[list[int]] = [[] for _ in range(order + 1)]
        for g in sorted(grams, key=len):
            for n in range(2, len(g) + 1):
                if g[:n] not in node:
                    node[g[:n]] = len(node)
                    keys[n].append(node[g[: n - 1]] * v + self.vocab[g[n - 1]])
                    ids[n].append(node[g[:n]])
        if len(node) * v >= 2**63:
            raise ValueError(f"an ARPA model of {len(node)} n-grams over {v} words is past the index's int64 keys")
        self.order = order
        self.keys, self.ids = [], []
        for n in range(order + 1):
            k = np.asarray(keys[n], dtype=np.int64)
            at = np.argsort(k, kind="stable")
            self.keys.append(k[at])
            self.ids.append(np.asarray(ids[n], dtype=np.int64)[at])
        self.prob = np.full(len(node), np.nan)
        self.listed = np.zeros(len(node), dtype=bool)
        self.backoff = np.zeros(len(node))
        for g, p in prob.items():
            self.prob[node[g]], self.listed[node[g]] = p, True
        for g, b in backoff.items():
            self.backoff[node[g]] = b
        self.unk = self.vocab[UNK]

    def _child(self, n: int, parent: Any, word: Any) -> Any:
        """The nodes of the n-grams ``parent`` + ``word`` (-1: not an n-gram or prefix of the model)."""
        import numpy as np

        keys = self.keys[n]
        out = np.full(len(parent), -1, dtype=np.int64)
        ok = (parent >= 0) & (word >= 0)
        if not len(keys) or not ok.any():
            return out
        q = parent[ok] * self.n_words + word[ok]
        at = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
        out[ok] = np.where(keys[at] == q, self.ids[n][at], -1)
        return out

    def score(self, sentences: Sequence[Sequence[str]], bos: bool, eos: bool) -> list[float]:
        """log10 probability of each token sentence, as ``ArpaModel.reference_score`` adds it up."""
        import numpy as np

        extra = int(bos) + int(eos)  # <s> and </s> around each sentence's words
        lens = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences)) + extra
        starts = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(sentences) else np.zeros(0, dtype=np.int64)
        total = int(lens.sum())
        if not total:
            return [0.0] * len(sentences)
        local = np.arange(total, dtype=np.int64) - np.repeat(starts, lens)  # position in its sentence
        word = np.empty(total, dtype=np.int64)  # the history's words (-1: not a word of the model)
        inner = np.ones(total, dtype=bool)
        if bos:
            word[starts], inner[starts] = self.vocab.get(BOS, -1), False
        if eos:
            word[starts + lens - 1], inner[starts + lens - 1] = self.vocab.get(EOS, -1), False
        words = chain.from_iterable(sentences)  # one C loop of dict lookups, not a tuple per word and order
        word[inner] = np.fromiter(map(self.vocab.get, words, repeat(-1)), dtype=np.int64, count=total - len(sentences) * extra)
        known = word >= 0
        known[known] = self.listed[word[known]]
        scored = np.where(known, word, self.unk)  # the word a position is scored as (<unk> when unlisted)
        ctx = np.minimum(local, self.order - 1)  # context length of each position
        hist: list[Any] = [None, word]  # hist[n][i]: node of the n tokens ending at i (-1: none)
        best = scored.copy()  # node of the longest listed n-gram ending in the scored word
        best_n = np.ones(total, dtype=np.int64)
        for n in range(2, self.order + 1):
            prev = np.concatenate(([-1], hist[n - 1][:-1]))
            prev[local < n - 1] = -1  # the n-gram would start before its sentence
            node = self._child(n, prev, scored)
            hit = node >= 0
            hit[hit] = self.listed[node[hit]]
            best = np.where(hit, node, best)
            best_n = np.where(hit, n, best_n)
            if n < self.order:
                hist.append(np.where(known, node, self._child(n, prev, word)) if not known.all() else node)
        backoff = np.zeros(total)
        for n in range(self.order - 1, 0, -1):  # longest context first, as the per-word sum adds them
            before = np.concatenate(([-1], hist[n][:-1]))
            use = (n <= ctx) & (n >= best_n) & (before >= 0)
            backoff = backoff + np.where(use, self.backoff[np.maximum(before, 0)], 0.0)
        value = (self.prob[best] + backoff).tolist()
        out = []
        first = 1 if bos else 0  # <s> is context, never scored
        for a, n in zip(starts.tolist(), lens.tolist(), strict=True):
            t = 0.0
            for x in value[a + first : a + n]:
                t += x
            out.append(t)
        return out
