"""The shape shared by the quality-dimension stages (coherence, expertise, diversity, timeliness).

Their decisions need the whole run (a percentile bucket, a top fraction, a cluster, a cluster cap),
so a filter that decides one document at a time does not fit. Each runs in three steps:

1. **score** every input shard (in shard workers, cached per shard by ``ctx.cached_map`` under a key
   of the stage version, the scoring config and the shard's sha256): one JSON list of per-document
   score dicts per shard, in row order;
2. **decide** in the parent from the scores alone (cheap, and re-appliable later from the kept and
   rejected documents' stored scores): for each document ``None`` (kept) or a reject reason, and
   extra metadata fields;
3. **write** each shard: kept documents to ``shards/``, rejected ones (with ``reject_reason`` and
   ``rejected_by``) to ``rejected/``, every one of them with its scores in
   ``metadata["scores"][<stage>]``; the counts go through the one curation funnel
   (:func:`llmpipe.curation.funnel.report_funnel`), so ``in == kept + sum(rejected)``.

A stage that is not enabled passes its input through (hard links, an all-kept funnel), so the DAG
keeps its shape and downstream keys stay meaningful.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.curation.funnel import merge_funnels, report_funnel
from llmpipe.document import (
    REJECTED,
    SHARDS,
    InputShard,
    dump_metadata,
    input_shards,
    load_metadata,
    shard_schema,
    write_shard,
    write_table,
)
from llmpipe.files import jsonl_values, link_file
from llmpipe.lazy import lazy_import
from llmpipe.stage import StageContext
from llmpipe.store import hash_json

pa = lazy_import("pyarrow")
pq = lazy_import("pyarrow.parquet")
# ids, texts and metadata (with the scores) are unique per row: a dictionary for them only costs time,
# in the writer and in every reader downstream
DICTIONARY_COLUMNS = ("source",)
SCORES = "scores.json"  # per shard, in the shard cache: the score dicts of its documents in row order


@dataclass
class Decision:
    """What the decide step says about one document."""

    reason: str | None = None  # None = kept
    meta: dict[str, Any] = field(default_factory=dict)  # extra metadata fields (duplicate_of, weight)
    scores: dict[str, Any] = field(default_factory=dict)  # added to the stored scores (bucket, cluster)


def _score_job(arg: tuple[Callable[[str, Any], list[dict[str, Any]]], str, Any], out_dir: Path) -> dict[str, Any]:
    fn, shard, payload = arg
    scores = fn(shard, payload)
    (out_dir / SCORES).write_bytes(_dump_scores(scores))
    return {"docs": len(scores)}


def _dump_scores(scores: list[dict[str, Any]]) -> bytes:
    """A shard's scores as JSON (sorted keys). orjson writes it ~8x faster than json and, like
    :func:`llmpipe.document.dump_metadata` for the scores stored on the documents, writes a NaN as
    null: the decide step sees what a re-applied rule later reads off the documents."""
    try:
        import orjson

        return orjson.dumps(scores, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (ImportError, TypeError):  # no orjson, or a value it cannot write (an int past 64 bits)
        return json.dumps(scores, sort_keys=True, ensure_ascii=False).encode()


class ScoreFiles:
    """A run's scores: one file per input shard (in the shard cache), read one shard at a time.

    Why not a list of every document's score dict: at 2M documents that list is ~1 GB in the
    parent. The decide step needs a column or two of it (gathered into arrays of 8 bytes a document),
    and the write step each shard's own scores, which its worker reads from the file.
    """

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        for path in self.paths:
            yield _read_scores(path)

    def __len__(self) -> int:
        return len(self.paths)


def score_shards(ctx: StageContext, shards: Sequence[InputShard], fn: Callable[[str, Any], list[dict[str, Any]]],
                 payload: Any, key: Any, desc: str) -> ScoreFiles:
    """Per shard, ``fn(shard_path, payload)`` -> one score dict per document (cached per shard).

    ``fn`` is a top-level function (it runs in shard workers); ``key`` is everything the scores
    depend on besides the shard's content (the scoring config, a model's content hash).
    """
    items = [(hash_json([ctx.name, ctx.spec.version, "score", key, s.sha256]), (fn, str(s.path), payload))
             for s in shards]
    results = ctx.cached_map(_score_job, items, desc=desc)
    return ScoreFiles([d / SCORES for d, _ in results])


def _read_scores(path: Path) -> list[dict[str, Any]]:
    """A shard's scores file: orjson reads it 2-3x faster; json for what orjson refuses (NaN)."""
    data = path.read_bytes()
    try:
        import orjson
    except ImportError:  # pragma: no cover
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


Rule = Callable[[dict[str, Any]], Decision]  # a document's score dict -> its decision (picklable)


def _write_job(job: tuple[str, str, str, str, Any, Any]) -> dict[str, Any]:
    """One shard's kept and rejected files, scores in metadata; its funnel.

    ``scores``: the shard's scores file, a list of score dicts, or None (no scores of its own);
    ``decisions``: a list, or a :data:`Rule` applied here to each score dict (the parent then never
    holds a decision per document). Only the metadata column goes through Python (parsed, scores
    added, dumped again); ids, texts and sources stay Arrow columns, filtered into the two files:
    the same rows as writing :class:`Document` objects, without turning every text into a Python
    string and back.
    """
    src, out, name, stage_name, scores, decisions = job
    table = pq.read_table(src, columns=["id", "text", "source", "metadata"], use_threads=False)  # workers: parallel
    if isinstance(scores, Path):
        scores = _read_scores(scores)
    elif scores is None:
        scores = [{}] * table.num_rows  # one shared empty dict: only read below, never changed
    if table.num_rows != len(scores):
        raise RuntimeError(f"{stage_name}: {src}: {len(scores)} scores for {table.num_rows} documents")
    if callable(decisions):
        decisions = [decisions(sc) for sc in scores]
    metas, keep = [], []
    reasons: Counter[str] = Counter()
    for m, sc, dec in zip(table.column("metadata").to_pylist(), scores, decisions, strict=True):
        meta = load_metadata(m)
        meta.setdefault("scores", {})[stage_name] = {**sc, **dec.scores} if dec.scores else sc
        if dec.meta:
            meta.update(dec.meta)
        if dec.reason is not None:
            meta["reject_reason"] = dec.reason
            meta["rejected_by"] = stage_name
            reasons[dec.reason] += 1
        keep.append(dec.reason is None)
        metas.append(dump_metadata(meta))
    table = pa.Table.from_arrays([*table.columns[:3], pa.array(metas, pa.string())], schema=shard_schema())
    kept = table.filter(pa.array(keep, pa.bool_()))
    write_table(Path(out) / SHARDS / name, kept, dictionary=DICTIONARY_COLUMNS)
    write_table(Path(out) / REJECTED / name, table.filter(pa.array([not k for k in keep], pa.bool_())),
                dictionary=DICTIONARY_COLUMNS)
    n = table.num_rows
    return {"in": n, "kept": kept.num_rows, "rejected": dict(reasons),
            "filters": {stage_name: {"in": n, "out": kept.num_rows}}}


def write_decisions(ctx: StageContext, shards: Sequence[InputShard],
                    scores: ScoreFiles | Sequence[list[dict[str, Any]]] | None,
                    decisions: Rule | Sequence[list[Decision]], extra_funnel: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Step 3 for every shard, then the stage funnel (checked, written, reported); returns it.

    ``scores``: per shard (a :class:`ScoreFiles` is read by each shard's worker), or None;
    ``decisions``: per shard, or one :data:`Rule` the workers apply to each document's scores.
    """
    per_shard_scores: Sequence[Any] = (scores.paths if isinstance(scores, ScoreFiles)
                                       else scores if scores is not None else [None] * len(shards))
    per_shard_decisions: Sequence[Any] = [decisions] * len(shards) if callable(decisions) else decisions
    for s, sc, dec in zip(shards, per_shard_scores, per_shard_decisions, strict=True):
        if isinstance(sc, list) and isinstance(dec, list) and len(sc) != len(dec):
            raise RuntimeError(f"{ctx.name}: {s.name}: {len(dec)} decisions for {len(sc)} documents")
    jobs = [(str(s.path), str(ctx.out), s.name, ctx.name, sc, dec)
            for s, sc, dec in zip(shards, per_shard_scores, per_shard_decisions, strict=True)]
    funnel = merge_funnels(ctx.map(_write_job, jobs))
    funnel.pop("seconds", None)
    if extra_funnel:
        funnel.update(extra_funnel)
    report_funnel(ctx, ctx.name, funnel)
    return funnel


def pass_through(ctx: StageContext, upstream: str) -> dict[str, Any]:
    """A stage that is off: kept shards are the input files (hard links), nothing rejected."""
    shards = input_shards(ctx.inputs[upstream])
    n = 0
    for s in shards:
        link_file(s.path, ctx.out / SHARDS / s.name)
        write_shard(ctx.out / REJECTED / s.name, [])
        n += pq.ParquetFile(s.path).metadata.num_rows
    report_funnel(ctx, ctx.name, {"in": n, "kept": n, "rejected": {}, "filters": {}})
    return {"enabled": False, "docs_in": n, "docs_kept": n, "shards": len(shards)}


def stage_stats(funnel: dict[str, Any], shards: int, **extra: Any) -> dict[str, Any]:
    """The manifest stats every dimension stage returns (the funnel's counts, like the filter stages)."""
    return {"enabled": True, "docs_in": funnel["in"], "docs_kept": funnel["kept"], "rejected": funnel["rejected"],
            "shards": shards, **extra}


def resolve_path(ctx: StageContext, path: str) -> Path:
    """A config path, relative to the config file's folder."""
    p = Path(path).expanduser()
    if not p.is_absolute() and ctx.pipeline is not None and hasattr(ctx.pipeline, "base_dir"):
        p = ctx.pipeline.base_dir() / p
    return p


BUILTIN_REFERENCES = ("builtin:pydoc",)  # reference sets that ship with Python itself (offline)


def reference_texts(ctx: StageContext, spec: str, what: str) -> list[str]:
    """The documents of one reference entry: a file (see :func:`read_texts`) or ``builtin:pydoc``,
    the topics of Python's reference manual (``pydoc_data.topics``: reference prose, always there)."""
    if spec == "builtin:pydoc":
        from pydoc_data.topics import topics

        return [t for _, t in sorted(topics.items()) if len(t.split()) >= 50]
    if spec.startswith("builtin:"):
        raise ValueError(f"{what}: unknown built-in reference {spec!r} (there is {', '.join(BUILTIN_REFERENCES)})")
    return read_texts(resolve_path(ctx, spec), what)


def read_texts(path: Path, what: str) -> list[str]:
    """Reference documents from a file: ``.jsonl`` (a ``text`` field per line) or text (one per non-empty line).

    A bad line raises naming the file and the line.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no file at {path}")
    out: list[str] = []
    if path.suffix == ".jsonl":
        for where, rec in jsonl_values(path):
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise ValueError(f"{where}: needs a string 'text' field")
            out.append(rec["text"])
    else:
        out = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not out:
        raise ValueError(f"{what}: {path} holds no documents")
    return out
