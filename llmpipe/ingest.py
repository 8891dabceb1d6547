"""The ``ingest`` stage: raw sources → normalized ``Document`` shards, bad records quarantined.

Each source file is one unit of work (and of caching: a nightly refresh that adds files reads only
the new ones). A source given as an fsspec URL is read where it lives: each shard job opens its
file's URL itself (streaming, :func:`open_source`), whole files per job. Every record read ends as a document or as a quarantine line naming ``file:line``
and the reason, so ``read = ingested + quarantined`` holds for each file and for the stage; the cut
tail of a truncated ``.gz``/``.zst`` counts as one quarantined record at the line it reached.

Nothing a record holds besides its text is dropped: every other field, nested objects and arrays
included, lands at the same place in the document's metadata (JSON, so ``null``, ints, floats and
unicode come back exactly; ``Document.meta("metadata.published")`` reads one) and every later
stage carries it on. A UTF-8 byte order mark at the start of a line is stripped.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import gzip
import hashlib
import json
import math
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from llmpipe.config import IngestConfig, SourceConfig
from llmpipe.document import (
    ID_BYTES,
    SHARD_GLOB,
    SHARDS,
    Document,
    shard_schema,
    stable_id,
    write_shard,
    write_table,
)
from llmpipe.files import link_file
from llmpipe.sources import UNKNOWN, HashCache, SourceError, is_url, source_files, url_files
from llmpipe.stage import StageContext, stage
from llmpipe.store import hash_json

# 2: sha256 ids; snappy shards, dictionary only on the source column. 3: nested fields and every
# Parquet / save_to_disk column kept, BOMs stripped, truncated streams reported by line, text_lines
# without the CR of CRLF, integers past 64 bits exact. 4: a glob's files named under its fixed prefix;
# shard names end in a hash of (source, relative path), not of the content; ingested counted as written
VERSION = "4"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark: Windows editors start a file with it
_BLOCK = 1 << 16  # compressed bytes read (and decompressed) at a time


@dataclass(frozen=True)
class IngestUnit:
    """One unit of ingest work, as :func:`plan_inputs` plans it: a whole source file, or one byte range
    (``chunk``) of a large uncompressed JSONL file. Each unit is one cached shard job (its key: the
    content hash, the chunk and the reading fields) and writes shards ``<prefix>-00000.parquet``, ...
    """

    source: str  # the source's name: the documents' ``source`` column, and part of every id
    path: Path | str  # the file to read: a local ``Path``, or the ``str`` fsspec URL of a URL source's file
    format: str  # jsonl, parquet, text, text_lines or hf_disk (``auto`` is resolved when planning)
    rel: str  # the file's name inside its source: in ids, shard names and ``metadata["file"]``
    sha256: str  # the file's content hash (a URL file's: ``sources.url_identity``, its store's checksum)
    display: str  # how quarantine lines name the file (``<source>:<rel>`` for a built-in corpus)
    prefix: str  # the shard names' start: ``shard_prefix(source, rel)[-c<chunk no>]``
    text_field: str  # the JSON key / column holding the text
    id_field: str | None  # the JSON key / column with the record's own id (kept as ``orig_id``)
    source_key: str  # the content key of the whole source (``source:<name>`` input of the stage)
    chunk: tuple[int, ...] | None = None  # (start byte, end byte, first line, newlines); None: whole file


@dataclass(frozen=True)
class IngestJob:
    """One shard job of the ingest stage (what :func:`ingest_file` runs in a worker): a planned unit and
    the stage's settings; ``fast=False`` skips the Arrow fast path (the tests compare the two)."""

    unit: IngestUnit
    config: IngestConfig
    fast: bool = True


class Bad(Exception):
    """A record that cannot become a document; the message is the quarantine reason, ``kind`` the
    reason's name in the stats' counts (the message up to its first colon unless given)."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind or message.split(":")[0]


def normalize(text: str, form: str, strip_control: bool) -> str:
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if form != "none" and not unicodedata.is_normalized(form, text):
        text = unicodedata.normalize(form, text)
    if strip_control:
        text = _CONTROL.sub("", text)
    return text


def file_name(path: Path | str) -> str:
    """The last part of a local path or of a URL."""
    return path.name if isinstance(path, Path) else path.rstrip("/").rsplit("/", 1)[-1]


def open_source(path: Path | str) -> BinaryIO:
    """A source file opened for reading bytes: a local path, or a URL file streamed from where it lives
    (fsspec reads ahead in blocks; nothing is downloaded whole)."""
    if isinstance(path, Path):
        return open(path, "rb")
    import fsspec

    return fsspec.open(path, "rb").open()


def _compression(path: Path | str) -> str | None:
    name = file_name(path).lower()
    return "gzip" if name.endswith(".gz") else "zstd" if name.endswith(".zst") else None


def _gzip_blocks(raw: BinaryIO) -> Iterator[bytes]:
    """The decompressed bytes of a gzip file (every member); ``read1`` hands over what came before a
    cut, where ``read`` and line iteration drop it with the error."""
    with gzip.GzipFile(fileobj=raw, mode="rb") as f:
        while block := f.read1(_BLOCK):
            yield block


def _zstd_blocks(raw: BinaryIO) -> Iterator[bytes]:
    """The decompressed bytes of a zstd file, every frame; EOFError when the last frame is cut (zstd's
    stream reader ends such a file silently, as if it were complete)."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    dobj, in_frame = dctx.decompressobj(), False
    while data := raw.read(_BLOCK):
        while data:
            out = dobj.decompress(data)
            in_frame = True
            if out:
                yield out
            if not dobj.eof:
                break
            data, dobj, in_frame = dobj.unused_data, dctx.decompressobj(), False
    if in_frame:
        raise EOFError("the file ends inside a zstd frame")


def _stream_cut(kind: str, last_line: int, error: Exception) -> Bad:
    """The quarantine reason of a compressed stream that stops early (EOFError) or turns corrupt."""
    after = f"after line {last_line}" if last_line else "before its first line"
    if isinstance(error, EOFError):
        return Bad(f"truncated {kind} stream {after}", kind=f"truncated {kind} stream")
    detail = f"{type(error).__name__}: {error}"
    return Bad(f"corrupt {kind} stream {after}: {detail}", kind=f"corrupt {kind} stream")


def _compressed_lines(path: Path | str, kind: str) -> Iterator[tuple[int, bytes | Bad]]:
    """(line number, bytes with their newline) of a compressed file; where the stream stops early
    or is corrupt, a last ``Bad`` at the line it reached stands for the cut tail (whatever part of
    that line was decompressed is dropped with it: a cut line is never taken for a whole one)."""
    errors: tuple[type[Exception], ...] = (OSError, EOFError, zlib.error)
    if kind == "zstd":
        import zstandard

        errors += (zstandard.ZstdError,)
    with open_source(path) as raw:  # outside the try: a file that cannot be opened is no stream error
        blocks = _gzip_blocks(raw) if kind == "gzip" else _zstd_blocks(raw)
        last = 0
        try:  # an error ends the splitter too: the part of a line decompressed so far goes with it
            for last, line in _split_lines(blocks):
                yield last, line
        except errors as e:
            yield last + 1, _stream_cut(kind, last, e)


def _lines(path: Path | str, chunk: tuple[int, ...] | None) -> Iterator[tuple[int, bytes | Bad]]:
    """(line number, bytes) of a file, or of one chunk ``(start, end, first_line, ...)`` of it; a
    compressed file's cut tail comes as a last ``Bad`` (see ``_compressed_lines``)."""
    if chunk is None:
        kind = _compression(path)
        if kind is not None:
            yield from _compressed_lines(path, kind)
            return
        with open_source(path) as raw:
            yield from enumerate(raw, start=1) if isinstance(path, Path) else _block_lines(raw)
        return
    start, end, first_line = chunk[:3]
    with open_source(path) as f:
        f.seek(start)
        pos = start
        lines = f if isinstance(path, Path) else (line for _, line in _block_lines(f))
        for no, line in enumerate(lines, start=first_line):
            if pos >= end:
                break
            pos += len(line)
            yield no, line


def _block_lines(raw: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes with their newline) of a stream read in blocks: a remote file's
    ``readline`` reads (and copies) a whole read-ahead block per line."""
    return _split_lines(iter(lambda: raw.read(_BLOCK), b""))


def _split_lines(blocks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes with their newline) of a stream given as blocks; lines end at LF only, as a
    plain file's do, and a line that spans blocks is joined once, however long."""
    no, pending = 1, []
    for block in blocks:
        start = 0
        while (end := block.find(b"\n", start) + 1) > 0:
            line = block[start:end]
            if pending:
                line, pending = b"".join([*pending, line]), []
            yield no, line
            no, start = no + 1, end
        if start < len(block):
            pending.append(block[start:])
    if pending:
        yield no, b"".join(pending)


def chunk_bounds(path: Path, n: int) -> list[list[int]]:
    """``n`` byte ranges of a file cut at line starts: ``[start, end, first_line, newlines]`` each."""
    return scan_file(path, n, digest=False)[1]


def scan_file(path: Path, n: int, digest: bool = True, block: int = 1 << 20) -> tuple[str, list[list[int]]]:
    """The sha256 of a file and its ``n`` chunk ranges (see ``chunk_bounds``), from one read of it.

    A cut falls after the first newline at or after ``size * i / n``. Counting the newlines before
    each cut means workers never re-read a prefix to number their lines (nor count their own). The
    hash runs in a thread (hashlib frees the GIL) while this one counts, on two alternating buffers.
    """
    with open(path, "rb", buffering=0) as f:
        return _scan(f, path.stat().st_size, n, digest, block)


def _scan(f: BinaryIO, size: int, n: int, digest: bool, block: int = 1 << 20) -> tuple[str, list[list[int]]]:
    """:func:`scan_file` on an open stream of ``size`` bytes (a local file, or a URL file's stream)."""
    import numpy as np

    targets = sorted({size * i // n - 1 for i in range(1, n) if size * i // n > 0})
    starts = {0: 1}  # cut offset -> line number there
    h = hashlib.sha256()
    bufs = (bytearray(block), bytearray(block))
    nl = np.empty(block, dtype=bool)  # numpy counts newlines 5x faster than bytes.count
    pos, line, t, job, turn = 0, 1, 0, None, 0
    with ThreadPoolExecutor(1) as pool:
        while got := f.readinto(bufs[turn]):
            buf = bufs[turn]
            np.equal(np.frombuffer(buf, np.uint8), 10, out=nl)
            if job is not None:
                job.result()  # the other buffer is free again once its hash update is done
            if digest:
                job = pool.submit(h.update, memoryview(buf)[:got])
            done = 0  # newlines of buf[:done] are counted in ``line``
            while t < len(targets) and targets[t] < pos + got:
                k = buf.find(b"\n", max(targets[t] - pos, 0), got)
                if k < 0:
                    break  # the cut lies in a later block
                if k + 1 > done:
                    line += int(np.count_nonzero(nl[done: k + 1]))
                    done = k + 1
                    starts[pos + done] = line
                t += 1
            line += int(np.count_nonzero(nl[done:got]))
            pos, turn = pos + got, 1 - turn
        if job is not None:
            job.result()
    starts[size] = line
    cuts = sorted(starts)
    bounds = [[a, b, starts[a], starts[b] - starts[a]] for a, b in zip(cuts, cuts[1:], strict=False)]
    return (h.hexdigest() if digest else ""), bounds


def _json_loads(line: bytes) -> Any:
    """A JSON line as json reads it, at orjson's speed: orjson reads an integer past 64 bits as a
    float, so a record holding an integral float that large is read again by json (exact ints)."""
    if _orjson is None:
        return json.loads(line)
    rec = _orjson.loads(line)
    return json.loads(line) if type(rec) in _CONTAINERS and _holds_big_float(rec) else rec


_CONTAINERS = {dict, list, float}


def _holds_big_float(value: Any) -> bool:
    """Whether a parsed JSON value holds an integral float of about 2**63 or more (in magnitude)
    anywhere: what orjson makes of an integer it cannot hold (a float such as 1e19 reads the same in
    json). A loop over a stack, not recursion: orjson accepts nesting deeper than Python's stack."""
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is float:
            if (v >= 9.2e18 or v <= -9.2e18) and v.is_integer():
                return True
        else:
            stack.extend(x for x in (v.values() if type(v) is dict else v) if type(x) in _CONTAINERS)
    return False


try:  # orjson parses 2-3x faster than json; same errors (its JSONDecodeError subclasses json's)
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None


def read_jsonl(path: Path | str, text_field: str, id_field: str | None,
               chunk: tuple[int, ...] | None = None) -> Iterator[tuple[str, Any, dict]]:
    """Yield (line number, text or Bad, extra metadata) for each non-blank line; the extra metadata
    is every other field of the record, as it is (nested objects and arrays included)."""
    for n, line in _lines(path, chunk):
        if isinstance(line, Bad):
            yield str(n), line, {}
            return
        if line.startswith(BOM):
            line = line[len(BOM):]
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
        extra = rec
        if id_field and id_field in rec:
            extra["orig_id"] = str(rec[id_field])
        yield str(n), text, extra


def jsonable(value: Any) -> Any:
    """A Parquet / Arrow cell as JSON can hold it, so that it rides the metadata JSON of every shard.

    JSON's own values pass as they are, nested structs (dicts) and lists included; the others turn
    into text: dates and times ISO 8601, bytes UTF-8 (base64 where not UTF-8), NaN and infinities
    ``"NaN"``/``"Infinity"``/``"-Infinity"`` (JSON has no such numbers; orjson would write null),
    anything else (decimals, durations) ``str(value)``, which keeps every digit.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # a map column comes as a list of (key, value) tuples
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):  # datetime is a date
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(raw).decode("ascii")
    return str(value)


def _table_records(batches: Iterable[Any], text_field: str, id_field: str | None,
                   loc: Callable[[int], str]) -> Iterator[tuple[str, Any, dict]]:
    """(location, text or Bad, every other column of the row) of Arrow record batches or tables."""
    row = 0
    for batch in batches:
        data = batch.to_pydict()
        others = [c for c in data if c != text_field]
        for i, text in enumerate(data[text_field]):
            extra = {c: jsonable(data[c][i]) for c in others}
            if id_field and id_field in data:
                extra["orig_id"] = str(data[id_field][i])
            if not isinstance(text, str):
                yield loc(row), Bad(f"text is {type(text).__name__}, not a string"), {}
            else:
                yield loc(row), text, extra
            row += 1


def read_parquet(path: Path | str, text_field: str, id_field: str | None) -> Iterator[tuple[str, Any, dict]]:
    """Each row's text, with every other column (nested ones too) as metadata; a URL file is read
    through its fsspec file object (Parquet seeks to its footer and column chunks, no whole download)."""
    import pyarrow.parquet as pq

    with contextlib.nullcontext(path) if isinstance(path, Path) else open_source(path) as f:
        pf = pq.ParquetFile(f)
        if text_field not in pf.schema_arrow.names:
            raise Bad(f"no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)})")
        batches = pf.iter_batches(batch_size=8192)
        yield from _table_records(batches, text_field, id_field, lambda i: f"row {i + 1}")


def _text_line(line: bytes) -> bytes:
    """A text line without its line end (LF or CRLF) or a leading byte order mark."""
    line = line[:-1] if line.endswith(b"\n") else line
    line = line[:-1] if line.endswith(b"\r") else line
    return line[len(BOM):] if line.startswith(BOM) else line


def read_text(path: Path | str, per_line: bool) -> Iterator[tuple[str, Any, dict]]:
    """A text file (plain, ``.gz`` or ``.zst``) as one document, or one per non-blank line."""
    if not per_line:
        parts: list[bytes] = []
        for _, line in _lines(path, None):
            if isinstance(line, Bad):
                yield "1", line, {}
                return
            parts.append(line)
        data = b"".join(parts)
        data = data[len(BOM):] if data.startswith(BOM) else data
        try:
            yield "1", data.decode("utf-8"), {}
        except UnicodeDecodeError as e:
            yield "1", Bad(f"undecodable bytes (not UTF-8) at byte {e.start}"), {}
        return
    for n, raw in _lines(path, None):
        if isinstance(raw, Bad):
            yield str(n), raw, {}
            return
        line = _text_line(raw)
        if not line.strip():
            continue
        try:
            yield str(n), line.decode("utf-8"), {}
        except UnicodeDecodeError as e:
            yield str(n), Bad(f"undecodable bytes (not UTF-8) at byte {e.start}"), {}


def read_hf_disk(path: Path, text_field: str, id_field: str | None) -> Iterator[tuple[str, Any, dict]]:
    """Each row of a ``save_to_disk`` dataset (every split), with every other column as metadata;
    read as Arrow, so image or audio features stay their stored values instead of being decoded."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = [(name, ds[name]) for name in sorted(ds)]
    else:
        splits = [("", ds)]
    for split, part in splits:
        if text_field not in part.column_names:
            raise Bad(f"no column {text_field!r} (columns: {', '.join(part.column_names)})")
        batches = part.with_format("arrow").iter(batch_size=8192)
        yield from _table_records(batches, text_field, id_field,
                                  (lambda i, s=split: f"{s}[{i}]") if split else (lambda i: f"row {i + 1}"))


def iter_records(path: Path | str, fmt: str, text_field: str, id_field: str | None,
                 chunk: tuple[int, ...] | None = None) -> Iterator[tuple[str, Any, dict]]:
    if fmt == "jsonl":
        return read_jsonl(path, text_field, id_field, chunk)
    if fmt == "parquet":
        return read_parquet(path, text_field, id_field)
    if fmt in ("text", "text_lines"):
        return read_text(path, per_line=fmt == "text_lines")
    if fmt == "hf_disk":
        if not isinstance(path, Path):
            raise Bad("a save_to_disk folder is read from a local path only", kind="unsupported format")
        return read_hf_disk(path, text_field, id_field)
    if fmt == UNKNOWN:
        raise Bad("unknown file type: its name does not tell the format (set sources[].format or narrow "
                  "sources[].glob)", kind="unknown file type")
    raise Bad(f"unsupported format {fmt!r}")


def _chunk_bytes(path: Path | str, chunk: tuple[int, ...] | None,
                 limit: int | None = None) -> tuple[bytes, int, int] | None:
    """The bytes of a file or of one chunk (see ``chunk_bounds``), its first line number and its
    number of lines; None when a whole file holds more than ``limit`` bytes."""
    with open_source(path) as f:
        if chunk is None:
            data = f.read() if limit is None else f.read(limit + 1)
            if limit is not None and len(data) > limit:
                return None
            newlines = data.count(b"\n")
        else:
            f.seek(chunk[0])
            data = f.read(chunk[1] - chunk[0])
            newlines = chunk[3]
    return data, (chunk[2] if chunk else 1), newlines + (0 if not data or data.endswith(b"\n") else 1)


# JSON cannot hold raw C0 controls: they arrive escaped (\u0007, \b, \f); DEL raw; C1 as UTF-8 C2 80..9F
_CONTROL_JSON = re.compile(rb"\\u00[0189][0-9a-fA-F]|\\u007[fF]|\\[bf]|\x7f|\xc2[\x80-\x9f]")


def _may_hold_control(data: bytes) -> bool:
    """Whether JSON bytes can decode to a control character (cheap byte scans before a regex pass)."""
    if b"\\" not in data and b"\x7f" not in data and b"\xc2" not in data:
        return False
    return _CONTROL_JSON.search(data) is not None


_SCALAR_TYPES = ("string", "large_string", "int64", "double", "bool")
_ESCAPED_CR = re.compile(rb"\\r|\\u000[dD]")
_JSON_ESCAPE = r'["\\\x00-\x1f]'  # what a JSON encoder escapes inside a string (RE2 syntax)
DICTIONARY_COLUMNS = ("source",)  # the other columns are unique per row: a dictionary only costs time
# Ingest writes every byte of every source once: snappy compresses at about twice zstd's speed (and
# reads back faster in the next stage) for shards about 1.5x larger; later stages write zstd.
COMPRESSION = "snappy"


def fast_jsonl(job: IngestJob, out: Path) -> dict[str, Any] | None:
    """Arrow's multithreaded JSON reader for clean JSONL: the same shards as the line loop, faster.

    Ids, line numbers and metadata JSON are built column-wise on the Arrow buffers (no Python object
    per document, apart from one hash call). Returns None (the caller then reads line by line, with
    exact quarantine reasons) as soon as anything is not plainly clean: a parse error, blank or CRLF
    lines, a missing or non-string text, nested or partly missing extra fields, a float that could
    have been written as an integer, or a text that would be quarantined as empty.
    """
    import pyarrow as pa
    import pyarrow.json as pajson

    unit, cfg = job.unit, job.config
    path, text_field = unit.path, unit.text_field
    if unit.format != "jsonl" or _compression(path) is not None:
        return None
    # a URL file is never cut in chunks (its line numbers would need a scan of it on the driver): one
    # larger than a chunk goes to the line loop, which streams it, instead of into memory whole
    got = _chunk_bytes(path, unit.chunk, None if isinstance(path, Path) else int(cfg.chunk_mb * (1 << 20)))
    if got is None:
        return None
    data, first_line, n_lines = got
    if data.startswith(BOM):  # as the line loop does; a BOM at a later line's start fails Arrow's parse
        data = data[len(BOM):]
    if not data or b"\r" in data:
        return None
    try:
        table = pajson.read_json(pa.py_buffer(data), read_options=pajson.ReadOptions(block_size=1 << 24))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    names = table.column_names  # blank lines yield no row: fewer rows than lines
    if table.num_rows != n_lines or text_field not in names or not pa.types.is_string(table[text_field].type):
        return None
    extras = [c for c in names if c != text_field]
    if table[text_field].null_count or any(
            str(table[c].type) not in _SCALAR_TYPES or table[c].null_count for c in extras):
        return None
    texts = _clean_texts(table[text_field].combine_chunks(), cfg, data)
    if not _long_enough(texts, cfg.min_chars):
        return None
    source, rel = unit.source, unit.rel
    locs = _line_numbers(first_line, len(texts))
    metas = _metadata_json(table, extras, locs, rel, unit.id_field, data)
    if metas is None:
        return None
    ids = _stable_ids(source, rel, locs, texts)
    full = pa.Table.from_arrays([ids, texts, _repeat(source, len(texts)), metas], schema=shard_schema())
    read = full.num_rows
    if cfg.sample is not None:
        full = full.filter(pa.array([in_sample(i, cfg.sample) for i in ids.to_pylist()], pa.bool_()))
    step, written = cfg.max_docs_per_shard, 0
    for k, start in enumerate(range(0, full.num_rows, step)):
        part = full.slice(start, step)
        write_table(out / SHARDS / f"{unit.prefix}-{k:05d}.parquet", part,
                    dictionary=DICTIONARY_COLUMNS, compression=COMPRESSION)
        written += part.num_rows
    return {"read": read, "ingested": written, "quarantined": 0, "reasons": {}, "fast": True,
            **_sampled_out(cfg, read - full.num_rows)}


def in_sample(doc_id: str, fraction: float) -> bool:
    """Whether a document is in a smoke run's sample: a salted hash of its id below ``fraction``.

    The id is already a content hash, so the same documents are chosen on every run and machine; the
    salt keeps the choice independent of everything else keyed on ids (the validation split).
    """
    digest = hashlib.sha256(b"llmpipe-sample\x00" + doc_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


def _sampled_out(cfg: IngestConfig, n: int) -> dict[str, int]:
    """The documents a smoke run's sample left out (counted, so read = ingested + quarantined + these)."""
    return {"sampled_out": n} if cfg.sample is not None else {}


def _clean_texts(texts: Any, cfg: IngestConfig, data: bytes) -> Any:
    """``normalize`` on a whole column; a pass runs only when the raw bytes can need it."""
    import pyarrow.compute as pc

    escapes = b"\\" in data
    if escapes and _ESCAPED_CR.search(data):  # raw CR bytes were declined: only escaped ones
        texts = pc.replace_substring(pc.replace_substring(texts, "\r\n", "\n"), "\r", "\n")
    if cfg.normalization != "none" and not (  # ASCII is its own NFC and NFKC: skip the pass
            data.isascii() and (not escapes or pc.all(pc.string_is_ascii(texts)).as_py())):
        texts = pc.utf8_normalize(texts, form=cfg.normalization)
    if cfg.strip_control and _may_hold_control(data):
        texts = pc.replace_substring_regex(texts, pattern=_CONTROL.pattern, replacement="")
    return texts


def _long_enough(texts: Any, min_chars: int) -> bool:
    """Whether no text would be quarantined as empty (``len(text.strip()) < max(1, min_chars)``)."""
    import pyarrow.compute as pc

    if min_chars <= 1:  # only empty or all-whitespace texts fall short; Arrow's spaces are Python's
        return pc.min(pc.binary_length(texts)).as_py() > 0 and not pc.any(pc.utf8_is_space(texts)).as_py()
    return pc.min(pc.utf8_length(pc.utf8_trim_whitespace(texts))).as_py() >= min_chars


def _string_array(values: list[bytes]) -> Any:
    """A string array built from its buffers (``pa.array`` on Python objects imports pandas: ~1 s)."""
    import numpy as np
    import pyarrow as pa

    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))]
    return pa.Array.from_buffers(pa.large_string(), len(values), buffers).cast(pa.string())


def _scalar(value: str) -> Any:
    return _string_array([value.encode()])[0]


def _repeat(value: str, n: int) -> Any:
    import numpy as np
    import pyarrow as pa

    raw = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(raw)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(raw * n)])


def _line_numbers(first: int, n: int) -> Any:
    """``str(first + row)`` for each row, as a string column."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    numbers = np.arange(first, first + n, dtype=np.int64)
    return pc.cast(pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(numbers)]), pa.string())


def _stable_ids(source: str, rel: str, locs: Any, texts: Any) -> Any:
    """``stable_id(source, f"{rel}:{loc}", text)`` per row: the messages are joined column-wise, then one
    sha256 call per row on a slice of the joined buffer, and the hex formatting is done once for all."""
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    def scalar(b: bytes) -> Any:
        return _string_array([b])[0].cast(pa.large_binary())

    msgs = pc.binary_join_element_wise(
        scalar(f"{source}\x00{rel}:".encode("utf-8", "surrogatepass")), locs.cast(pa.large_binary()),
        scalar(b"\x00"), texts.cast(pa.large_binary()), scalar(b"\x00"), scalar(b""))
    n = len(msgs)
    offs = np.frombuffer(msgs.buffers()[1], np.int64)[msgs.offset: msgs.offset + n + 1].tolist()
    buf, sha = memoryview(msgs.buffers()[2]), hashlib.sha256
    joined = b"".join([sha(buf[a:b]).digest() for a, b in zip(offs[:-1], offs[1:], strict=True)])
    digests = np.frombuffer(joined, np.uint8)
    hexed = digests.reshape(n, 32)[:, :ID_BYTES].tobytes().hex().encode()
    offsets = np.arange(n + 1, dtype=np.int32) * (2 * ID_BYTES)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(hexed)])


def _metadata_json(table: Any, extras: list[str], locs: Any, rel: str, id_field: str | None,
                   data: bytes) -> Any:
    """``dump_metadata({"file": rel, "loc": loc, **extra, "orig_id": ...})`` per row, column-wise:
    sorted keys, each value's JSON token as a column, joined. None where that cannot match exactly."""
    try:
        rel.encode()
    except UnicodeEncodeError:
        return None
    cols: dict[str, Any] = {"file": _dumps(rel), "loc": _join('"', locs, '"')}
    for c in extras:  # a record's own "file"/"loc" fields win, as in the line loop
        cols[c] = _json_tokens(table[c].combine_chunks(), c, data)
    if id_field and id_field in extras:
        cols["orig_id"] = _orig_id_tokens(table[id_field].combine_chunks(), id_field, data)
    if any(v is None for v in cols.values()):
        return None
    item_sep, key_sep = _separators()
    parts: list[Any] = []
    for i, key in enumerate(sorted(cols)):
        parts += ["{" if i == 0 else item_sep, _dumps(key), key_sep, cols[key]]
    return _join(*parts, "}")


def _join(*parts: Any) -> Any:
    """Concatenate string columns and str constants row by row (adjacent constants merged first)."""
    import pyarrow.compute as pc

    merged: list[Any] = []
    for p in parts:
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    columns = [_scalar(p) if isinstance(p, str) else p for p in merged]
    return pc.binary_join_element_wise(*columns, _scalar(""))


def _dumps(value: Any) -> str:
    """JSON of one value as ``dump_metadata`` writes it inside a dict (orjson, else json)."""
    return _orjson.dumps(value).decode() if _orjson is not None else json.dumps(value, ensure_ascii=False)


def _separators() -> tuple[str, str]:
    """``dump_metadata``'s item and key separators: orjson is compact, json puts a space after each."""
    return (",", ":") if _orjson is not None else (", ", ": ")


def _all_float_literals(data: bytes, key: str, rows: int) -> bool:
    """Whether each row spells ``key``'s number as a float (``1.0``, ``1e3``), never as an int (``1``):
    the line loop writes ``1`` for an int that Arrow reads into a float column. Inside JSON strings a
    quote is escaped, so the pattern only meets keys; a key spelled with escapes is not counted (the
    count falls short and the caller declines)."""
    pattern = re.escape(_dumps(key).encode()) + rb"\s*:\s*-?[0-9]+(?:\.[0-9]|[eE])"
    return sum(1 for _ in re.finditer(pattern, data)) == rows


def _json_tokens(col: Any, key: str, data: bytes) -> Any:
    """Each value's JSON text as ``dump_metadata`` writes it, or None (the line loop then decides)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = str(col.type)
    if kind in ("int64", "bool"):
        return pc.cast(col, pa.string())
    if kind == "double":  # an integral float may stand for an int literal (1, not 1.0) in the file
        if pc.any(pc.equal(col, pc.floor(col))).as_py() and not _all_float_literals(data, key, len(col)):
            return None
        raw = _dumps(col.to_pylist())  # one call; a float's JSON never holds a comma
        return _string_array([t.encode() for t in raw[1:-1].split(_separators()[0])])
    col = col.cast(pa.string())
    if pc.any(pc.match_substring_regex(col, _JSON_ESCAPE)).as_py():
        return _string_array([_dumps(v).encode() for v in col.to_pylist()])
    return _join('"', col, '"')


def _orig_id_tokens(col: Any, key: str, data: bytes) -> Any:
    """JSON of ``str(value)`` of the id field: ``orig_id`` in the metadata."""
    import pyarrow.compute as pc

    kind = str(col.type)
    if kind == "int64":
        return _join('"', pc.cast(col, "string"), '"')
    if kind == "bool":
        return pc.if_else(col, _scalar('"True"'), _scalar('"False"'))
    if kind == "double":  # str(float) is Python's own formatting: leave it to the line loop
        return None
    return _json_tokens(col, key, data)


def ingest_file(job: IngestJob, out: Path) -> dict[str, Any]:
    """Read one source file (or chunk) into shards under ``out/shards``; quarantine what cannot be read."""
    if isinstance(job.unit.path, str) and job.unit.chunk is None:
        bounds = _url_chunks(job.unit.path, job.unit.format, job.config.chunk_mb)
        if len(bounds) > 1:
            return _ingest_url_chunks(job, out, bounds)
    stats, quarantine = _ingest_unit(job, out)
    if quarantine:
        out.mkdir(parents=True, exist_ok=True)  # a file with no document has no shards folder either
        (out / "quarantine.jsonl").write_text(
            "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in quarantine))
    return stats


def _url_chunks(url: str, fmt: str, chunk_mb: float) -> list[list[int]]:
    """The chunk bounds a local run cuts the same file into (``[]``: not cut). Found by the shard job
    in one streamed read of the file, not by the planner (which would read every file on the driver)."""
    if fmt != "jsonl" or _compression(url) is not None:
        return []
    import fsspec

    fs, p = fsspec.core.url_to_fs(url)
    size = fs.size(p)
    n = max(1, math.ceil(size / (chunk_mb * (1 << 20))))
    if n == 1:
        return []
    with open_source(url) as f:
        return _scan(f, size, n, digest=False)[1]


def _ingest_url_chunks(job: IngestJob, out: Path, bounds: list[list[int]]) -> dict[str, Any]:
    """A URL file larger than a chunk: each chunk read (by range) and written as a local run's chunk job
    writes it (``<prefix>-c<i>-<k>.parquet``), one after the other, so the shards are the local run's
    and the memory held is a chunk's."""
    totals: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    quarantine: list[dict[str, Any]] = []
    for i, b in enumerate(bounds):
        unit = dataclasses.replace(job.unit, chunk=tuple(b), prefix=f"{job.unit.prefix}-c{i:04d}")
        stats, q = _ingest_unit(dataclasses.replace(job, unit=unit), out)
        quarantine += q
        reasons.update(stats["reasons"])
        totals.update({k: v for k, v in stats.items() if k in ("read", "ingested", "quarantined", "sampled_out")})
    if quarantine:
        out.mkdir(parents=True, exist_ok=True)
        (out / "quarantine.jsonl").write_text(
            "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in quarantine))
    return {"read": totals["read"], "ingested": totals["ingested"], "quarantined": totals["quarantined"],
            "reasons": dict(reasons), **_sampled_out(job.config, totals["sampled_out"])}


def _ingest_unit(job: IngestJob, out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One unit's stats and quarantine lines; its shards written under ``out/shards``."""
    if job.fast:
        fast = fast_jsonl(job, out)
        if fast is not None:
            return fast, []
        for f in (out / SHARDS).glob(f"{job.unit.prefix}-*.parquet"):  # a declined fast path's part
            f.unlink()
    unit, cfg = job.unit, job.config
    rel, where = unit.rel, unit.display
    reasons: Counter[str] = Counter()
    quarantine: list[dict[str, Any]] = []
    docs: list[Document] = []
    shard_no, read, sampled_out, written = 0, 0, 0, 0

    def flush() -> None:
        nonlocal docs, shard_no, written
        if docs:
            written += write_shard(out / SHARDS / f"{unit.prefix}-{shard_no:05d}.parquet", docs,
                                   dictionary=DICTIONARY_COLUMNS, compression=COMPRESSION)
            shard_no += 1
            docs = []

    try:
        for loc, text, extra in iter_records(unit.path, unit.format, unit.text_field, unit.id_field, unit.chunk):
            read += 1
            if isinstance(text, Bad):
                reason, kind = str(text), text.kind
            else:
                text = normalize(text, cfg.normalization, cfg.strip_control)
                reason = kind = "" if len(text.strip()) >= max(1, cfg.min_chars) else "empty text"
            if reason:
                reasons[kind] += 1
                quarantine.append({"where": f"{where}:{loc}", "reason": reason})
                continue
            doc_id = stable_id(unit.source, f"{rel}:{loc}", text)
            if cfg.sample is not None and not in_sample(doc_id, cfg.sample):
                sampled_out += 1
                continue
            meta = {"file": rel, "loc": loc, **extra}
            docs.append(Document(doc_id, text, unit.source, meta))
            if len(docs) >= cfg.max_docs_per_shard:
                flush()
    except Bad as e:  # the whole file is unreadable (e.g. missing column)
        read += 1
        reasons[e.kind] += 1
        quarantine.append({"where": where, "reason": str(e)})
    except (OSError, EOFError, ValueError) as e:  # a corrupt Parquet file and the like
        read += 1
        reasons["unreadable file"] += 1
        quarantine.append({"where": where, "reason": f"unreadable file: {type(e).__name__}: {e}"})
    flush()
    return {"read": read, "ingested": written, "quarantined": len(quarantine), "reasons": dict(reasons),
            **_sampled_out(cfg, sampled_out)}, quarantine


def _import_for_workers() -> None:
    """Import what the shard workers use here, once: forked workers then share it instead of each
    paying the import (about half a second) before its first chunk."""
    import numpy  # noqa: F401
    import pyarrow.compute  # noqa: F401
    import pyarrow.json  # noqa: F401
    import pyarrow.parquet  # noqa: F401


def plan_sources(pipeline: Any, state_dir: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The stage's ``plan_inputs``: each source's content key, and the files to read (``ctx.extra``)."""
    files, keys = plan_inputs(pipeline, state_dir)
    return keys, {"files": files}


@stage("ingest", version=VERSION, config_field="ingest", flow="data_refresh", plan_inputs=plan_sources)
def run_ingest(ctx: StageContext) -> dict[str, Any]:
    """Read every declared source into normalized Document shards; quarantine bad records."""
    units: list[IngestUnit] = ctx.extra["files"]
    key_cfg = ctx.config.key_dict()
    items = [(hash_json(["ingest", VERSION, key_cfg, u.source, u.rel, u.format, u.text_field, u.id_field,
                         u.sha256, u.chunk]), IngestJob(u, ctx.config)) for u in units]
    _import_for_workers()
    results = ctx.cached_map(ingest_file, items, desc="ingest files")
    totals: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    per_source: dict[str, Counter[str]] = {}
    quarantine_lines: list[str] = []
    on_disk = 0  # rows of the shards this artifact holds, counted from the files themselves
    for (shard_dir, stats), u in zip(results, units, strict=True):
        on_disk += _link_shards(shard_dir, ctx.out)
        q = shard_dir / "quarantine.jsonl"
        if q.is_file():
            quarantine_lines.append(q.read_text())
        for k in ("read", "ingested", "quarantined", *(("sampled_out",) if "sampled_out" in stats else ())):
            totals[k] += stats[k]
            per_source.setdefault(u.source, Counter())[k] += stats[k]
        reasons.update(stats["reasons"])
    (ctx.out / SHARDS).mkdir(parents=True, exist_ok=True)
    if quarantine_lines:
        (ctx.out / "quarantine.jsonl").write_text("".join(quarantine_lines))
    _check_counts(totals, on_disk)
    rows = [{"source": s, **dict(c)} for s, c in sorted(per_source.items())]
    ctx.report_table("ingest-counts", "Ingest: documents read, ingested and quarantined", rows)
    ctx.log.info("ingest: read %d, ingested %d, quarantined %d", totals["read"], totals["ingested"],
                 totals["quarantined"])
    return {**dict(totals), "quarantine_reasons": dict(reasons), "files": len(items),
            "sources": {u.source: u.source_key for u in units}, "per_source": rows}


def _link_shards(shard_dir: Path, out: Path) -> int:
    """Link one shard job's shards into the artifact; their rows, read from the files' footers. A name
    already there is an error, never an overwrite (a lost shard would still be counted)."""
    import pyarrow.parquet as pq

    rows = 0
    for f in sorted((shard_dir / SHARDS).glob(SHARD_GLOB)):
        dst = out / SHARDS / f.name
        if dst.exists():
            raise RuntimeError(f"ingest: two shard jobs wrote {f.name}; refusing to overwrite one with the other")
        link_file(f, dst)
        rows += pq.ParquetFile(dst).metadata.num_rows
    return rows


def _check_counts(totals: Counter[str], on_disk: int) -> None:
    """Every record read is a document on disk, a quarantine line or sampled out; the documents are
    the rows in the shards. Anything else is a bug that lost (or invented) documents: fail the stage."""
    if totals["ingested"] != on_disk:
        raise RuntimeError(f"ingest: the shards hold {on_disk} documents but the shard jobs counted "
                           f"{totals['ingested']} written")
    accounted = totals["ingested"] + totals["quarantined"] + totals["sampled_out"]
    if totals["read"] != accounted:
        raise RuntimeError(f"ingest: read {totals['read']} records but {accounted} are accounted for "
                           f"(ingested + quarantined + sampled out)")


def shard_prefix(source: str, rel: str) -> str:
    """The start of a file's shard names: ``<source>-<slug of rel>-<hash of (source, rel)>``.

    The hash of the full relative path makes names that cannot collide (``a b.jsonl`` and ``a_b.jsonl``
    share a slug) and that do not change with the file's content or with what else the source holds;
    the slug first keeps arrival order for dated files (day1 < day2), which lets dedup treat a
    refresh's shards as new documents after the old ones.
    """
    return f"{source}-{_slug(rel)}-{hash_json([source, rel])[:16]}"


def _slug(rel: str) -> str:
    """A relative path as a readable piece of a file name (not unique: ``shard_prefix`` adds a hash)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", rel)[:80]


def _n_chunks(path: Path, fmt: str, chunk_mb: float) -> int:
    """Big uncompressed JSONL files are cut into byte ranges so that several workers share one file."""
    if fmt != "jsonl" or _compression(path) is not None or not path.is_file():
        return 1
    return max(1, math.ceil(path.stat().st_size / (chunk_mb * (1 << 20))))


def _scan_and_remember(cache: HashCache, n: int) -> Callable[[Path], str]:
    """A file's sha256 that also leaves its chunk bounds in the cache: one read of the file, not two."""
    def compute(path: Path) -> str:
        digest, bounds = scan_file(path, n)
        cache.memo(f"chunks2:{digest}:{n}", lambda: bounds)
        return digest

    return compute


def _hash_and_cut(cache: HashCache, path: Path, fmt: str, chunk_mb: float) -> tuple[str, list[list[int]]]:
    """A file's sha256 and, for a file big enough to share between workers, its chunk bounds (both
    remembered in the cache, keyed by the content hash)."""
    n = _n_chunks(path, fmt, chunk_mb)
    digest = cache.sha256(path, compute=_scan_and_remember(cache, n) if n > 1 else None)
    bounds = cache.memo(f"chunks2:{digest}:{n}", lambda: chunk_bounds(path, n)) if n > 1 else []
    return digest, bounds


def _file_units(src: SourceConfig, path: Path | str, fmt: str, rel: str, digest: str, bounds: list[list[int]],
                source_key: str) -> list[IngestUnit]:
    """The units of one file: the whole file, or one per chunk when it was cut in more than one."""
    chunks: list[tuple[int, ...] | None] = [tuple(b) for b in bounds] if len(bounds) > 1 else [None]
    prefix = shard_prefix(src.name, rel)
    display = f"{src.name}:{rel}" if src.path.startswith("builtin:") else str(path)
    return [IngestUnit(source=src.name, path=path, format=fmt, rel=rel, sha256=digest, display=display,
                       prefix=prefix if chunk is None else f"{prefix}-c{i:04d}", text_field=src.text_field,
                       id_field=src.id_field, source_key=source_key, chunk=chunk)
            for i, chunk in enumerate(chunks)]


def plan_inputs(pipeline: Any, state_dir: Path) -> tuple[list[IngestUnit], dict[str, str]]:
    """The files to ingest and each source's content key (``source:<name>`` inputs of the stage)."""
    cache = HashCache(state_dir / "source-hashes.json")
    units: list[IngestUnit] = []
    keys: dict[str, str] = {}
    for src in pipeline.sources:
        if is_url(src.path):  # listed where it lives; whole files per job (no byte-range chunks)
            files: list[tuple[Any, str, str, str, list[list[int]]]] = [
                (url, fmt, rel, ident, []) for url, fmt, rel, ident in url_files(src)]
        else:
            files = [(path, fmt, rel, *_hash_and_cut(cache, Path(path), fmt, pipeline.ingest.chunk_mb))
                     for path, fmt, rel in source_files(src, pipeline.base_dir(), state_dir)]
        key = keys[f"source:{src.name}"] = hash_json([(rel, fmt, digest) for _, fmt, rel, digest, _ in files])
        for path, fmt, rel, digest, bounds in files:
            units += _file_units(src, path, fmt, rel, digest, bounds, key)
    cache.save()
    _check_unique_names(units)
    return units, keys


def _check_unique_names(units: list[IngestUnit]) -> None:
    """Two files with one shard name would overwrite each other's documents: refuse before any work."""
    seen: dict[str, IngestUnit] = {}
    for u in units:
        other = seen.setdefault(u.prefix, u)
        if other is not u:
            raise SourceError(f"sources: {other.display} and {u.display} would share the shard name {u.prefix}")
