"""``llmpipe export``: a document stage's documents as a dataset to take away from llmpipe.

The store's artifacts are content-addressed folders meant for the pipeline; an export is a plain
folder meant for everything else (``datasets``, pandas, another pipeline). For the artifact of the
config's current plan (the one ``llmpipe run CONFIG --until STAGE`` made), ``DIR`` gets:

- ``kept/<shard>.parquet`` or ``kept/<shard>.jsonl``: the stage's kept documents;
- ``rejected/<shard>.*`` (``--rejected``): the documents the stage removed, each with
  ``reject_reason`` (and ``rejected_by``, the filters' ``scores``, dedup's ``duplicate_of``) in
  its metadata; ``quarantine.jsonl`` for ingest, whose bad records never became documents;
- ``export.json``, written last: stage, key, the artifact's config and inputs (its lineage), the
  format and the counts. A folder without it is an unfinished export.

Parquet files are the artifact's shards byte for byte (columns ``id``, ``text``, ``source`` and
``metadata``, the metadata as JSON text): ``datasets.load_dataset("parquet", data_dir=DIR/kept)``.
A JSONL line is the record that ingest reads back into the same document: ``{"text": ..., <each
metadata field>}``. The metadata's ``file`` and ``loc`` win over the new file's, as a record's own
fields always do in ingest, so a source pointing at ``DIR/kept`` gives the same texts and metadata;
the documents get new ids (from that source, file and line), like any ingested record, and the old
ids are not a field (they would collide with a metadata ``id`` from the original source).
Empty shards are skipped.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.document import REJECTED, SHARD_GLOB, SHARDS
from llmpipe.lazy import lazy_import

pq = lazy_import("pyarrow.parquet")

DOCUMENT_STAGES = ("ingest", "langid", "quality", "coherence", "expertise", "safety", "entities", "dedup", "diversity",
                   "timeliness", "augment")
FORMATS = ("parquet", "jsonl")
KEPT_DIR, REJECTED_DIR = "kept", "rejected"
QUARANTINE = "quarantine.jsonl"  # ingest's records that could not become documents (where + reason)
EXPORT_JSON = "export.json"
TEXT = "text"  # the JSONL text field: ingest's default ``text_field``


class ExportError(ValueError):
    """The export cannot start (unknown or non-document stage, no artifact yet, a used folder)."""


@dataclass
class ExportResult:
    """What an export wrote; ``rejected`` is None when rejected documents were not asked for."""

    stage: str
    key: str
    out: Path
    format: str
    kept: int
    kept_files: list[str] = field(default_factory=list)
    rejected: int | None = None
    rejected_files: list[str] = field(default_factory=list)
    quarantined: int | None = None

    def summary(self) -> list[str]:
        """What was written, for the command line."""
        def files(names: list[str]) -> str:
            return f"{len(names)} {self.format} file{'s' * (len(names) != 1)}"

        lines = [f"{self.stage} {self.key[:12]}: {self.kept} kept documents in {files(self.kept_files)} "
                 f"-> {self.out / KEPT_DIR}"]
        if self.rejected is not None:
            lines.append(f"{self.rejected} rejected documents in {files(self.rejected_files)} "
                         f"-> {self.out / REJECTED_DIR}")
        if self.quarantined is not None:
            lines.append(f"{self.quarantined} quarantined records (ingest) -> {self.out / QUARANTINE}")
        return lines


def check_stage(stage: str) -> None:
    """Raise ExportError unless ``stage`` is a document stage (checked before any planning)."""
    if stage in DOCUMENT_STAGES:
        return
    from llmpipe.pipeline import load_stages

    if stage not in load_stages():
        raise ExportError(f"unknown stage {stage!r}; document stages: {', '.join(DOCUMENT_STAGES)}")
    raise ExportError(f"stage {stage!r} does not hold documents; document stages: {', '.join(DOCUMENT_STAGES)}")


def export_stage(cfg: Any, stage: str, to: str | Path, fmt: str = "parquet", rejected: bool = False,
                 config_ref: str = "CONFIG") -> ExportResult:
    """Export ``stage``'s artifact for ``cfg``'s current plan; ``config_ref`` spells the config in the hint."""
    from llmpipe.dag import open_store, plan

    check_stage(stage)
    check_format(fmt)
    key = plan(cfg)[stage].key
    art = open_store(cfg).get(stage, key)
    if art is None:
        raise ExportError(f"stage {stage!r} has no artifact for this config yet (key {key[:12]}): "
                          f"run `llmpipe run {config_ref} --until {stage}` first")
    return export_artifact(art.path, to, fmt, rejected, stage=stage, key=key, manifest=art.manifest)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def export_artifact(artifact: Path, to: str | Path, fmt: str = "parquet", rejected: bool = False, *,
                    stage: str = "", key: str = "", manifest: dict[str, Any] | None = None) -> ExportResult:
    """Export one document artifact folder into ``to`` (see the module docstring for the layout).

    Everything is written into a hidden folder inside ``to`` and moved into place at the end, with
    ``export.json`` last; a folder that already holds any of the export's names is refused rather
    than mixed with another export or overwritten.
    """
    check_format(fmt)
    out = Path(to)
    taken = [n for n in (KEPT_DIR, REJECTED_DIR, QUARANTINE, EXPORT_JSON) if (out / n).exists()]
    if taken:
        raise ExportError(f"{out}: already holds {', '.join(taken)}; export into a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".export-{uuid.uuid4().hex[:8]}"
    try:
        result = ExportResult(stage, key, out, fmt, 0)
        result.kept, result.kept_files = _write_all(artifact / SHARDS, tmp / KEPT_DIR, fmt)
        if rejected:
            result.rejected, result.rejected_files = _write_all(artifact / REJECTED, tmp / REJECTED_DIR, fmt)
            if (artifact / QUARANTINE).is_file():
                shutil.copyfile(artifact / QUARANTINE, tmp / QUARANTINE)
                result.quarantined = _count_lines(tmp / QUARANTINE)
        for name in (KEPT_DIR, REJECTED_DIR, QUARANTINE):
            if (tmp / name).exists():
                (tmp / name).rename(out / name)
        _write_summary(out / EXPORT_JSON, result, manifest or {})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _write_all(src_dir: Path, dst_dir: Path, fmt: str) -> tuple[int, list[str]]:
    """Every non-empty shard of ``src_dir`` into ``dst_dir``: (documents, file names written)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    docs, names = 0, []
    for shard in sorted(src_dir.glob(SHARD_GLOB)):
        rows = pq.ParquetFile(shard).metadata.num_rows
        if rows == 0:
            continue
        if fmt == "parquet":
            dst = dst_dir / shard.name
            shutil.copyfile(shard, dst)  # a copy, never a link: the export may be edited, the store must not be
        else:
            dst = dst_dir / f"{shard.stem}.jsonl"
            _write_jsonl(shard, dst)
        docs += rows
        names.append(dst.name)
    return docs, names


def _write_jsonl(shard: Path, dst: Path) -> None:
    with open(dst, "w", encoding="utf-8", newline="\n") as f:
        for line in jsonl_lines(shard):
            f.write(line)


def jsonl_lines(shard: Path, batch_size: int = 4096) -> Iterator[str]:
    """One JSONL line per document of ``shard``: ``{"text": ..., <the metadata's fields>}``.

    The metadata's JSON text is spliced in as the shard stores it, so numbers, unicode and nesting
    come back exactly as they were, without a parse and re-encode per document.
    """
    pf = pq.ParquetFile(shard)
    row = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=["id", TEXT, "metadata"]):
        cols = batch.to_pydict()
        for doc_id, text, meta in zip(cols["id"], cols[TEXT], cols["metadata"], strict=True):
            row += 1
            yield _line(text, (meta or "{}").strip(), f"{shard}: row {row} (document {doc_id})")


def _line(text: str, meta: str, where: str) -> str:
    if not (meta.startswith("{") and meta.endswith("}")):
        raise ExportError(f"{where}: metadata is not a JSON object")
    if f'"{TEXT}"' in meta and TEXT in json.loads(meta):  # parsed only when the name occurs at all
        raise ExportError(f"{where}: its metadata has a {TEXT!r} field, which a JSONL line cannot hold beside "
                          "the text; export this stage as parquet")
    head = '{"text":' + _dumps(text)
    rest = meta[1:].strip()
    return f"{head}}}\n" if rest == "}" else f"{head},{rest}\n"


def _dumps(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _write_summary(path: Path, r: ExportResult, manifest: dict[str, Any]) -> None:
    """``export.json``: what was exported and from which artifact (its lineage starts there)."""
    summary: dict[str, Any] = {
        "stage": r.stage, "key": r.key, "version": manifest.get("version"), "created": manifest.get("created"),
        "config": manifest.get("config"), "inputs": manifest.get("inputs"), "format": r.format,
        "kept": {"documents": r.kept, "files": [f"{KEPT_DIR}/{n}" for n in r.kept_files]},
        "rejected": None if r.rejected is None else
        {"documents": r.rejected, "files": [f"{REJECTED_DIR}/{n}" for n in r.rejected_files]},
    }
    if r.quarantined is not None:
        summary["quarantined"] = {"records": r.quarantined, "file": QUARANTINE}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.rename(path)
