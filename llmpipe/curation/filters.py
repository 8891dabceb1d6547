"""The filter framework shared by the curation stages (datatrove style, with scores kept).

A :class:`Filter` has a ``name`` and ``filter(doc) -> keep | (False, reason)``. Filters that can
decide from numbers subclass :class:`ScoredFilter`: ``scores(doc)`` computes every statistic (no
early exit) and stores it in ``doc.metadata["scores"][name]``, and ``decide(scores)`` applies the
thresholds. Because the scores travel with the document (kept *and* rejected), a threshold can be
re-applied later with ``decide`` alone, without recomputing anything.

:func:`apply_filters` owns batching, counting reasons, and writing rejected documents. Every input
document ends kept, rejected with a reason, or quarantined (a filter raised on it: reason
``error:<ExceptionType>``, the rest of the shard goes on), so ``in == kept + sum(rejected)``.
A document's error is its own; a filter that raises on many documents is a broken filter, not bad
data: :func:`check_error_share` fails the stage past a configured share (``max_error_share``),
instead of publishing a stage that "succeeded" by rejecting everything as ``error:<Type>``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from llmpipe.curation.funnel import check_funnel, funnel_rows, merge_funnels, write_funnel
from llmpipe.document import Document, iter_documents, rejected_paths, write_shard

# the funnel lives in llmpipe.curation.funnel (every curation stage writes one); re-exported here
__all__ = ["Filter", "FilterChain", "FilterErrors", "ScoredFilter", "apply_filters", "check_error_share",
           "check_funnel", "first_error", "funnel_rows", "merge_funnels", "write_funnel"]

FilterResult = bool | tuple[bool, str]
ERROR_PREFIX = "error:"  # the reason of a document a filter raised on: error:<ExceptionType>


class FilterErrors(RuntimeError):
    """More of a stage's documents hit filter errors than its ``max_error_share`` allows."""


def check_error_share(funnel: dict[str, Any], limit: float, key: str,
                      example: Callable[[], str | None] = lambda: None) -> int:
    """The number of documents that hit a filter error; raises FilterErrors when their share of the
    funnel's input is above ``limit`` (``key`` names the setting; ``example()``, called only then,
    gives one error message to show)."""
    errors = {r: n for r, n in funnel["rejected"].items() if r.startswith(ERROR_PREFIX)}
    n, total = sum(errors.values()), funnel["in"]
    if total and n / total > limit:
        kinds = ", ".join(f"{r} x{c}" for r, c in sorted(errors.items()))
        raise FilterErrors(f"{n} of {total} documents ({n / total:.1%}) hit a filter error ({kinds}), more than "
                           f"{key} = {limit}" + (f"; the first: {first}" if (first := example()) else ""))
    return n


def first_error(out: Path) -> str | None:
    """The first filter error message among a stage's rejected documents (``<out>/rejected``): what
    :func:`check_error_share` shows when it fails, so it is read only then."""
    for p in rejected_paths(out):
        for d in iter_documents(p):
            if "error" in d.metadata:
                return str(d.metadata["error"])
    return None


class Filter:
    """A named keep/drop decision on one document. Subclasses override ``filter`` (or ``filter_batch``)."""

    name: str = "filter"

    def filter(self, doc: Document) -> FilterResult:
        raise NotImplementedError

    def filter_batch(self, docs: Sequence[Document]) -> list[FilterResult]:
        """Decide a batch; override when the work vectorizes (e.g. one model call per batch)."""
        return [self.filter(d) for d in docs]

    def set_scores(self, doc: Document, scores: dict[str, Any]) -> None:
        doc.metadata.setdefault("scores", {})[self.name] = scores

    def stat_update(self, key: str, value: int = 1) -> None:
        """Count something beyond keep/drop (datatrove's hook): e.g. PII redactions per type.

        The counts land in the stage's funnel under ``stats[<filter name>]``, summed over shards,
        and the stage reports them as a table; no stage needs to know which filter counted what.
        """
        if not hasattr(self, "stats"):
            self.stats: Counter[str] = Counter()
        self.stats[key] += value


class ScoredFilter(Filter):
    """A filter whose decision is a pure function of stored scores (thresholds re-appliable)."""

    def scores(self, doc: Document) -> dict[str, Any]:
        raise NotImplementedError

    def decide(self, scores: dict[str, Any]) -> str | None:
        """The reason to drop, or None to keep."""
        raise NotImplementedError

    def filter(self, doc: Document) -> FilterResult:
        s = self.scores(doc)
        self.set_scores(doc, s)
        reason = self.decide(s)
        return True if reason is None else (False, reason)


def _normalize(result: FilterResult, default_reason: str) -> str | None:
    """None when kept, else the drop reason."""
    if isinstance(result, tuple):
        keep, reason = result
        return None if keep else (reason or default_reason)
    return None if result else default_reason


class FilterChain:
    """Runs filters in order over batches; counts decisions per reason and per filter."""

    def __init__(self, filters: Sequence[Filter]) -> None:
        names = [f.name for f in filters]
        if len(set(names)) != len(names):
            raise ValueError(f"filter names must be unique, got {names}")
        self.filters = list(filters)
        self.reasons: Counter[str] = Counter()
        self.per_filter = {f.name: {"in": 0, "out": 0, "seconds": 0.0} for f in filters}
        self.n_in = 0
        self.n_kept = 0

    def run_batch(self, docs: list[Document]) -> tuple[list[Document], list[Document]]:
        """(kept, rejected); rejected docs carry ``reject_reason`` and ``rejected_by`` in metadata."""
        self.n_in += len(docs)
        alive, rejected = docs, []
        for f in self.filters:
            if not alive:
                break
            t0 = time.perf_counter()
            results = self._safe_batch(f, alive)
            stats = self.per_filter[f.name]
            stats["seconds"] += time.perf_counter() - t0
            stats["in"] += len(alive)
            nxt = []
            for doc, reason in zip(alive, results, strict=True):
                if reason is None:
                    nxt.append(doc)
                    continue
                doc.metadata["reject_reason"] = reason
                doc.metadata["rejected_by"] = f.name
                self.reasons[reason] += 1
                rejected.append(doc)
            stats["out"] += len(nxt)
            alive = nxt
        self.n_kept += len(alive)
        return alive, rejected

    def _safe_batch(self, f: Filter, docs: list[Document]) -> list[str | None]:
        """Reasons per doc. When the batch call raises, retry one by one so only the bad doc is quarantined."""
        try:
            return [_normalize(r, f.name) for r in f.filter_batch(docs)]
        except Exception:  # noqa: BLE001 - isolate the document that breaks the filter
            out: list[str | None] = []
            for d in docs:
                try:
                    out.append(_normalize(f.filter(d), f.name))
                except Exception as e:  # noqa: BLE001 - quarantine, never lose the shard
                    d.metadata["error"] = f"{f.name}: {type(e).__name__}: {str(e)[:300]}"
                    out.append(f"{ERROR_PREFIX}{type(e).__name__}")
            return out

    def funnel(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "in": self.n_in,
            "kept": self.n_kept,
            "rejected": dict(sorted(self.reasons.items())),
            "filters": {k: {**v, "seconds": round(v["seconds"], 4)} for k, v in self.per_filter.items()},
        }
        counted = {f.name: dict(sorted(f.stats.items())) for f in self.filters if getattr(f, "stats", None)}
        if counted:
            out["stats"] = counted
        return out


def _batches(docs: Iterable[Document], size: int) -> Iterable[list[Document]]:
    batch: list[Document] = []
    for d in docs:
        batch.append(d)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def apply_filters(
    shard_in: str | Path,
    shard_out: str | Path,
    rejected_out: str | Path,
    filters: Sequence[Filter],
    batch_size: int = 1024,
) -> dict[str, Any]:
    """Filter one shard: kept docs to ``shard_out``, rejected (reason + scores) to ``rejected_out``.

    Returns the funnel: ``{"in", "kept", "rejected": {reason: n}, "filters": {name: {in, out, seconds}}}``,
    plus ``"stats": {filter: {key: n}}`` where a filter counted something (:meth:`Filter.stat_update`).
    Both output files are always written (possibly empty), so downstream stages see one shard per input.
    """
    chain = FilterChain(filters)
    kept: list[Document] = []
    rejected: list[Document] = []
    t0 = time.perf_counter()
    for batch in _batches(iter_documents(shard_in), batch_size):
        k, r = chain.run_batch(batch)
        kept.extend(k)
        rejected.extend(r)
    write_shard(shard_out, kept)
    write_shard(rejected_out, rejected)
    funnel = chain.funnel()
    funnel["seconds"] = round(time.perf_counter() - t0, 4)
    check_funnel(funnel, where=str(shard_in))
    return funnel
