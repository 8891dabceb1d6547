"""The ``ingest`` stage: raw sources → normalized ``Document`` shards, bad records quarantined.

Each source file is one unit of work (and of caching: a nightly refresh that adds files reads only
the new ones). Every record read ends as a document or as a quarantine line naming ``file:line``
and the reason, so ``read = ingested + quarantined`` holds for each file and for the stage.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import shutil
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmpipe.document import SCHEMA, Document, dump_metadata, stable_id, write_shard, write_table
from llmpipe.sources import HashCache, source_files
from llmpipe.stage import StageContext, link_file, stage
from llmpipe.store import hash_json

VERSION = "1"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class Bad(Exception):
    """A record that cannot become a document; the message is the quarantine reason."""


def normalize(text: str, form: str, strip_control: bool) -> str:
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if form != "none" and not unicodedata.is_normalized(form, text):
        text = unicodedata.normalize(form, text)
    if strip_control:
        text = _CONTROL.sub("", text)
    return text


def _open_binary(path: Path) -> io.BufferedIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))  # type: ignore[arg-type]
    return open(path, "rb")


def _lines(path: Path, chunk: tuple[int, int, int] | None) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a file, or of one chunk ``(start, end, first_line)`` of it."""
    if chunk is None:
        with _open_binary(path) as raw:
            yield from enumerate(raw, start=1)
        return
    start, end, first_line = chunk
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        for no, line in enumerate(f, start=first_line):
            if pos >= end:
                break
            pos += len(line)
            yield no, line


def chunk_bounds(path: Path, n: int) -> list[list[int]]:
    """``n`` byte ranges of a file cut at line starts, with each range's first line number.

    One sequential pass counts the newlines before each cut, so workers never re-read a prefix.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        cuts = sorted({_aligned(f, size * i // n) for i in range(n)} | {size})
        bounds, line, pos = [], 1, 0
        f.seek(0)
        for start, end in zip(cuts, cuts[1:], strict=False):
            line += _count_range(f, pos, start)
            pos = start
            bounds.append([start, end, line])
    return bounds


def _count_range(f: Any, start: int, end: int, block: int = 1 << 22) -> int:
    f.seek(start)
    count, left = 0, end - start
    while left > 0:
        data = f.read(min(block, left))
        if not data:
            break
        count += data.count(b"\n")
        left -= len(data)
    return count


def _aligned(f: Any, offset: int) -> int:
    """The first line start at or after ``offset``."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    f.readline()
    return f.tell()


def _json_loads(line: bytes) -> Any:
    return _orjson.loads(line) if _orjson is not None else json.loads(line)


try:  # orjson parses 2-3x faster than json; same errors (its JSONDecodeError subclasses json's)
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None


def read_jsonl(path: Path, text_field: str, id_field: str | None,
               chunk: tuple[int, int, int] | None = None) -> Iterator[tuple[str, Any, dict]]:
    """Yield (line number, text or Bad, extra metadata) for each non-blank line."""
    for n, line in _lines(path, chunk):
        if not line.strip():
            continue
        try:
            rec = _json_loads(line)
        except ValueError as e:
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as ue:
                yield str(n), Bad(f"undecodable bytes (not UTF-8) at byte {ue.start}"), {}
                continue
            msg = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) and _orjson is None \
                else str(e).split(": line")[0]
            yield str(n), Bad(f"malformed JSON: {msg}"), {}
            continue
        if not isinstance(rec, dict):
            yield str(n), Bad(f"expected a JSON object, got {type(rec).__name__}"), {}
            continue
        if text_field not in rec:
            yield str(n), Bad(f"missing text field {text_field!r}"), {}
            continue
        text = rec.pop(text_field)
        if not isinstance(text, str):
            yield str(n), Bad(f"text field {text_field!r} is {type(text).__name__}, not a string"), {}
            continue
        extra = {k: v for k, v in rec.items() if isinstance(v, (str, int, float, bool)) or v is None}
        if id_field and id_field in rec:
            extra["orig_id"] = str(rec[id_field])
        yield str(n), text, extra


def read_parquet(path: Path, text_field: str, id_field: str | None) -> Iterator[tuple[str, Any, dict]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise Bad(f"no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)})")
    row = 0
    cols = [text_field] + ([id_field] if id_field and id_field in pf.schema_arrow.names else [])
    for batch in pf.iter_batches(columns=cols, batch_size=8192):
        data = batch.to_pydict()
        for i, text in enumerate(data[text_field]):
            row += 1
            extra = {"orig_id": str(data[id_field][i])} if len(cols) > 1 else {}
            if not isinstance(text, str):
                yield f"row {row}", Bad(f"text is {type(text).__name__}, not a string"), {}
            else:
                yield f"row {row}", text, extra


def read_text(path: Path, per_line: bool) -> Iterator[tuple[str, Any, dict]]:
    data = path.read_bytes()
    if not per_line:
        try:
            yield "1", data.decode("utf-8"), {}
        except UnicodeDecodeError as e:
            yield "1", Bad(f"undecodable bytes (not UTF-8) at byte {e.start}"), {}
        return
    for n, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            yield str(n), line.decode("utf-8"), {}
        except UnicodeDecodeError as e:
            yield str(n), Bad(f"undecodable bytes (not UTF-8) at byte {e.start}"), {}


def read_hf_disk(path: Path, text_field: str, id_field: str | None) -> Iterator[tuple[str, Any, dict]]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = [(name, ds[name]) for name in sorted(ds)]
    else:
        splits = [("", ds)]
    for split, part in splits:
        if text_field not in part.column_names:
            raise Bad(f"no column {text_field!r} (columns: {', '.join(part.column_names)})")
        for i, rec in enumerate(part):
            loc = f"{split}[{i}]" if split else f"row {i + 1}"
            text = rec[text_field]
            extra = {"orig_id": str(rec[id_field])} if id_field and id_field in rec else {}
            yield loc, text if isinstance(text, str) else Bad("text is not a string"), extra


def iter_records(path: Path, fmt: str, text_field: str, id_field: str | None,
                 chunk: tuple[int, int, int] | None = None) -> Iterator[tuple[str, Any, dict]]:
    if fmt == "jsonl":
        return read_jsonl(path, text_field, id_field, chunk)
    if fmt == "parquet":
        return read_parquet(path, text_field, id_field)
    if fmt in ("text", "text_lines"):
        return read_text(path, per_line=fmt == "text_lines")
    if fmt == "hf_disk":
        return read_hf_disk(path, text_field, id_field)
    raise Bad(f"unsupported format {fmt!r}")


def _chunk_bytes(path: Path, chunk: tuple[int, int, int] | None) -> tuple[bytes, int]:
    """The bytes of a file or of one chunk ``(start, end, first_line)``, and its first line number."""
    with open(path, "rb") as f:
        if chunk is None:
            return f.read(), 1
        f.seek(chunk[0])
        return f.read(chunk[1] - chunk[0]), chunk[2]


# JSON cannot hold raw C0 controls: they arrive escaped (\u0007, \b, \f); DEL raw; C1 as UTF-8 C2 80..9F
_CONTROL_JSON = re.compile(rb"\\u00[0189][0-9a-fA-F]|\\u007[fF]|\\[bf]|\x7f|\xc2[\x80-\x9f]")


def _may_hold_control(data: bytes) -> bool:
    """Whether JSON bytes can decode to a control character (cheap byte scans before a regex pass)."""
    if b"\\" not in data and b"\x7f" not in data and b"\xc2" not in data:
        return False
    return _CONTROL_JSON.search(data) is not None


_SCALAR_TYPES = ("string", "large_string", "int64", "double", "bool")


def fast_jsonl(arg: dict[str, Any], out: Path) -> dict[str, Any] | None:
    """Arrow's multithreaded JSON reader for clean JSONL: the same shards as the line loop, faster.

    Returns None (the caller then reads line by line, with exact quarantine reasons) as soon as
    anything is not plainly clean: a parse error, blank or CRLF lines, a missing or non-string text,
    nested or partly missing extra fields, or a text that would be quarantined as empty.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pajson

    path, cfg, text_field = Path(arg["path"]), arg["config"], arg["text_field"]
    if arg["format"] != "jsonl" or path.name.lower().endswith((".gz", ".zst")):
        return None
    data, first_line = _chunk_bytes(path, tuple(arg["chunk"]) if arg.get("chunk") else None)
    if not data or b"\r" in data or b"\n\n" in data or data.startswith(b"\n"):
        return None
    try:
        table = pajson.read_json(pa.py_buffer(data), read_options=pajson.ReadOptions(block_size=1 << 24))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    n_lines = data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
    names = table.column_names
    if table.num_rows != n_lines or text_field not in names or not pa.types.is_string(table[text_field].type):
        return None
    extras = [c for c in names if c != text_field]
    if table[text_field].null_count or any(
            str(table[c].type) not in _SCALAR_TYPES or table[c].null_count for c in extras):
        return None
    texts = table[text_field].combine_chunks()
    if cfg["normalization"] != "none":
        texts = pc.utf8_normalize(texts, form=cfg["normalization"])
    if cfg["strip_control"] and _may_hold_control(data):
        texts = pc.replace_substring_regex(texts, pattern=_CONTROL.pattern, replacement="")
    lengths = pc.utf8_length(pc.utf8_trim_whitespace(texts))
    if pc.min(lengths).as_py() < max(1, cfg["min_chars"]):
        return None
    id_field, source, rel = arg["id_field"], arg["source"], arg["rel"]
    orig = extras.index(id_field) if id_field in extras else -1
    ids, metas = [], []
    rows = zip(texts.to_pylist(), *(table[c].to_pylist() for c in extras), strict=True)
    for row, (text, *values) in enumerate(rows):
        loc = str(first_line + row)
        meta = dict(zip(extras, values, strict=True))
        meta.setdefault("file", rel)  # a record's own "file"/"loc" fields win, as in the line loop
        meta.setdefault("loc", loc)
        if orig >= 0:
            meta["orig_id"] = str(values[orig])
        ids.append(stable_id(source, f"{rel}:{loc}", text))
        metas.append(dump_metadata(meta))
    full = pa.Table.from_arrays([pa.array(ids, pa.string()), texts, pa.array([source] * len(ids), pa.string()),
                                 pa.array(metas, pa.string())], schema=SCHEMA)
    step = cfg["max_docs_per_shard"]
    for k, start in enumerate(range(0, full.num_rows, step)):
        write_table(out / "shards" / f"{arg['prefix']}-{k:05d}.parquet", full.slice(start, step))
    return {"read": full.num_rows, "ingested": full.num_rows, "quarantined": 0, "reasons": {}, "fast": True}


def ingest_file(arg: dict[str, Any], out: Path) -> dict[str, Any]:
    """Read one source file into shards under ``out/shards``; quarantine what cannot be read."""
    if arg.get("fast", True):
        fast = fast_jsonl(arg, out)
        if fast is not None:
            return fast
        shutil.rmtree(out / "shards", ignore_errors=True)
    path, fmt, rel = Path(arg["path"]), arg["format"], arg["rel"]
    cfg = arg["config"]
    where = f"{arg['display']}"
    reasons: Counter[str] = Counter()
    quarantine: list[dict[str, Any]] = []
    docs: list[Document] = []
    shard_no, read = 0, 0

    def flush() -> None:
        nonlocal docs, shard_no
        if docs:
            write_shard(out / "shards" / f"{arg['prefix']}-{shard_no:05d}.parquet", docs)
            shard_no += 1
            docs = []

    try:
        chunk = tuple(arg["chunk"]) if arg.get("chunk") else None
        for loc, text, extra in iter_records(path, fmt, arg["text_field"], arg["id_field"], chunk):
            read += 1
            if isinstance(text, Bad):
                reason = str(text)
            else:
                text = normalize(text, cfg["normalization"], cfg["strip_control"])
                reason = "" if len(text.strip()) >= max(1, cfg["min_chars"]) else "empty text"
            if reason:
                reasons[reason.split(":")[0]] += 1
                quarantine.append({"where": f"{where}:{loc}", "reason": reason})
                continue
            meta = {"file": rel, "loc": loc, **extra}
            docs.append(Document(stable_id(arg["source"], f"{rel}:{loc}", text), text, arg["source"], meta))
            if len(docs) >= cfg["max_docs_per_shard"]:
                flush()
    except Bad as e:  # the whole file is unreadable (e.g. missing column)
        read += 1
        reasons[str(e).split(":")[0]] += 1
        quarantine.append({"where": where, "reason": str(e)})
    except (OSError, EOFError, ValueError) as e:  # corrupt compressed stream and the like
        read += 1
        reasons["unreadable file"] += 1
        quarantine.append({"where": f"{where}", "reason": f"unreadable file: {type(e).__name__}: {e}"})
    flush()
    if quarantine:
        (out / "quarantine.jsonl").write_text(
            "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in quarantine))
    ingested = read - len(quarantine)
    return {"read": read, "ingested": ingested, "quarantined": len(quarantine), "reasons": dict(reasons)}


@stage("ingest", version=VERSION, config_field="ingest", flow="data_refresh")
def run_ingest(ctx: StageContext) -> dict[str, Any]:
    """Read every declared source into normalized Document shards; quarantine bad records."""
    units = ctx.extra["files"]
    items = []
    for u in units:
        arg = {**u, "config": ctx.config.key_dict()}
        shard_key = hash_json(["ingest", VERSION, arg["config"], u["source"], u["rel"], u["format"],
                               u["text_field"], u["id_field"], u["sha256"], u.get("chunk")])
        items.append((shard_key, arg))
    results = ctx.cached_map(ingest_file, items, desc="ingest files")
    totals: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    per_source: dict[str, Counter[str]] = {}
    quarantine_lines: list[str] = []
    for (shard_dir, stats), (_, arg) in zip(results, items, strict=True):
        for f in sorted((shard_dir / "shards").glob("*.parquet")):
            link_file(f, ctx.out / "shards" / f.name)
        q = shard_dir / "quarantine.jsonl"
        if q.is_file():
            quarantine_lines.append(q.read_text())
        for k in ("read", "ingested", "quarantined"):
            totals[k] += stats[k]
            per_source.setdefault(arg["source"], Counter())[k] += stats[k]
        reasons.update(stats["reasons"])
    (ctx.out / "shards").mkdir(parents=True, exist_ok=True)
    if quarantine_lines:
        (ctx.out / "quarantine.jsonl").write_text("".join(quarantine_lines))
    assert totals["read"] == totals["ingested"] + totals["quarantined"]
    rows = [{"source": s, **dict(c)} for s, c in sorted(per_source.items())]
    ctx.report_table("ingest-counts", "Ingest: documents read, ingested and quarantined", rows)
    ctx.log.info("ingest: read %d, ingested %d, quarantined %d", totals["read"], totals["ingested"],
                 totals["quarantined"])
    return {**dict(totals), "quarantine_reasons": dict(reasons), "files": len(items),
            "sources": {u["source"]: u["source_key"] for u in units}, "per_source": rows}


def _slug(rel: str) -> str:
    """File names in shard names keep arrival order for dated files (day1 < day2), which lets dedup
    treat a refresh's shards as new documents after the old ones."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", rel)[:80]


def _n_chunks(path: Path, fmt: str, chunk_mb: float) -> int:
    """Big uncompressed JSONL files are cut into byte ranges so that several workers share one file."""
    if fmt != "jsonl" or path.name.lower().endswith((".gz", ".zst")) or not path.is_file():
        return 1
    return max(1, math.ceil(path.stat().st_size / (chunk_mb * (1 << 20))))


def plan_inputs(pipeline: Any, state_dir: Path) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The files to ingest and each source's content key (``source:<name>`` inputs of the stage)."""
    cache = HashCache(state_dir / "source-hashes.json")
    units: list[dict[str, Any]] = []
    keys: dict[str, str] = {}
    for src in pipeline.sources:
        files = source_files(src, pipeline.base_dir(), state_dir)
        parts = []
        for path, fmt, rel in files:
            digest = cache.sha256(path)
            parts.append((rel, fmt, digest))
            n = _n_chunks(path, fmt, pipeline.ingest.chunk_mb)
            bounds = cache.memo(f"chunks:{digest}:{n}", lambda p=path, k=n: chunk_bounds(p, k)) if n > 1 else []
            n = max(1, len(bounds))
            for i in range(n):
                units.append({"source": src.name, "path": str(path), "format": fmt, "rel": rel, "sha256": digest,
                              "display": f"{src.name}:{rel}" if src.path.startswith("builtin:") else str(path),
                              "prefix": f"{src.name}-{_slug(rel)}-{digest[:8]}" + (f"-c{i:04d}" if n > 1 else ""),
                              "text_field": src.text_field, "id_field": src.id_field,
                              "chunk": bounds[i] if n > 1 else None})
        keys[f"source:{src.name}"] = hash_json(parts)
        for u in units:
            if u["source"] == src.name:
                u["source_key"] = keys[f"source:{src.name}"]
    cache.save()
    return units, keys
