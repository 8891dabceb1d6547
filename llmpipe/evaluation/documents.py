"""Bits per byte over whole held-out documents, in lm-evaluation-harness's ``loglikelihood_rolling`` way.

The packed-window figure of :mod:`llmpipe.evaluation.metrics` scores fixed windows that start
mid-document, so a window's first tokens have almost no context and the number is not comparable
with published document-level figures. Here each held-out document (a piece of the tokenize
artifact: ``[BOS] ids EOS``) is scored on its own, every token exactly once, in rolling windows of
the model's length: the first window predicts the first ``window - 1`` tokens after a prefix token (BOS
when the document has one, else the previous document's EOS, as the harness conditions on its EOT
token); each later window predicts the next ``stride`` tokens with the ``window - 1 - stride`` tokens
before them as context. ``stride = window - 1`` (the default) gives exactly the harness's own disjoint
windows (``get_rolling_token_windows(context_len=1)`` + ``make_disjoint_window``) at its
``max_length = window - 1``: the model is also fed the last target (its logits unused), so it never
reads more than ``window`` positions; a smaller stride gives every token more left context
at ``window / stride`` times the cost.

Documents are read from the token shards, split at EOS, so the cost is linear in the split's size
and only ``max_docs`` evenly spaced documents are scored.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.evaluation.data import evenly_spaced, split_token_arrays
from llmpipe.evaluation.metrics import Tally, score_batch


def split_documents(ids: np.ndarray, eos_id: int, bos_id: int | None = None) -> list[np.ndarray]:
    """The documents of one shard's real ids, each ending with its EOS (a trailing piece without
    one, cut by the shard's end, is a document too). Where BOS and EOS are one id, a piece
    ``[BOS] ids EOS`` splits into ``[BOS]`` and ``ids EOS``: the lone BOS is joined to what follows."""
    ends = np.flatnonzero(ids == eos_id) + 1
    bounds = [0, *ends.tolist()]
    if bounds[-1] < len(ids):
        bounds.append(len(ids))
    docs = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    if bos_id is None or bos_id != eos_id:
        return docs
    out: list[np.ndarray] = []
    for d in docs:
        if out and len(out[-1]) == 1 and out[-1][0] == bos_id:
            out[-1] = np.concatenate([out[-1], d])
        else:
            out.append(d)
    return out


def iter_documents(tokenize_dir: str | Path, split: str) -> Iterator[np.ndarray]:
    """Every document of ``split`` of a tokenize artifact, shard by shard (padding excluded)."""
    index, arrays = split_token_arrays(tokenize_dir, split)
    for ids in arrays:
        yield from split_documents(np.asarray(ids, dtype=np.int64), int(index["eos_id"]), index.get("bos_id"))


def held_out_documents(tokenize_dir: str | Path, split: str, max_docs: int | None) -> tuple[list[np.ndarray], int]:
    """(``max_docs`` evenly spaced documents of ``split``, how many the split holds)."""
    docs = list(iter_documents(tokenize_dir, split))
    return [docs[i] for i in evenly_spaced(len(docs), max_docs)], len(docs)


def rolling_windows(n: int, window: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """(start, stop, targets) over a token array of length ``n`` whose first token is a prefix: the
    model reads ``tokens[start : stop + 1]`` (at most ``window`` tokens) and its last ``targets``
    predictions are scored (positions ``stop - targets + 1 .. stop``). Targets 1..n-1 are each
    scored exactly once; ``stride`` (default ``window - 1``: disjoint windows) is how many new
    targets each window after the first predicts."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    stride = window - 1 if stride is None else stride
    if not 1 <= stride <= window - 1:
        raise ValueError(f"evaluate.doc_stride must be in [1, window - 1 = {window - 1}], got {stride}")
    out, done = [], 0  # targets scored so far (positions 1..done)
    while done < n - 1:
        k = min(n - 1 - done, window - 1 if not out else stride)
        stop = done + k
        out.append((max(0, stop + 1 - window), stop, k))
        done += k
    return out


def document_metrics(model: Any, docs: list[np.ndarray], byte_len: np.ndarray, window: int,
                     eos_id: int, bos_id: int | None, stride: int | None = None,
                     batch_size: int = 8) -> dict[str, Any]:
    """Perplexity, bits per byte and accuracy over whole documents (every real token once; BOS,
    when a document starts with one, is the prefix and never a target)."""
    jobs: list[tuple[int, int, int, int]] = []  # (document, start, stop, targets)
    seqs = []
    for d, doc in enumerate(docs):
        toks = doc if bos_id is not None and len(doc) and doc[0] == bos_id else np.concatenate([[eos_id], doc])
        seqs.append(toks)
        jobs += [(d, *w) for w in rolling_windows(len(toks), window, stride)]
    total = Tally(sequences=len(docs))
    for i in range(0, len(jobs), batch_size):
        chunk = jobs[i : i + batch_size]
        batch = [seqs[d][a : b + 1] for d, a, b, _ in chunk]
        for (_, _, _, k), cols in zip(chunk, score_batch(model, batch, None, byte_len), strict=True):
            total.add(Tally(nll=float(cols["nll"][-k:].sum()), tokens=k, correct=int(cols["correct"][-k:].sum()),
                            bytes=int(cols["bytes"][-k:].sum())))
    out = total.metrics()
    out.update({"documents": len(docs), "windows": len(jobs), "window": window,
                "stride": window - 1 if stride is None else stride})
    return out


def model_window(model: Any, tokenizer: Any) -> int:
    """Tokens the model reads at once: its config's position limit, else the tokenizer's."""
    cfg = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(tokenizer, "model_max_length", None)
    if isinstance(v, int) and 0 < v < 10**7:
        return v
    raise ValueError("evaluate.documents: the model config names no maximum length; set evaluate.doc_window")
