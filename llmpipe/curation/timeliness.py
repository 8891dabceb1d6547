"""Timeliness: a date per document, its origin recorded, and a rule on its age.

Dates are taken in order of trust: a metadata field (``date_fields``, ISO 8601 or epoch seconds),
then the text: first the publication meta tags and ``<time datetime>`` of HTML (what ``htmldate``
reads first), then the first date written in the prose (ISO ``2021-03-04`` and ``2021/03/04``,
``4 March 2021`` / ``March 4, 2021``, German ``4. März 2021`` and ``04.03.2021``, CJK
``2021年3月4日``), and last, with ``file_mtime``, the modification date of the source file the
document came from (``mtime``). The origin (``metadata:<field>``, ``html``, ``text``, ``mtime`` or
none) is stored beside the date, so a rule can later trust some origins only. The stage key holds
the sources' content, not their modification times: touching a file alone does not re-date its
documents until the stage reruns (the per-shard scores are keyed by the dates read).

Ages are measured from ``reference_date`` in the config, never from the clock: the stage key, and
so the cache, must not change from one day to the next. ``max_age_days`` rejects older documents as
``stale``; ``half_life_days`` writes ``metadata["recency_weight"] = 0.5 ** (age / half_life)``,
which the tokenize stage multiplies into the document's train sampling factor; undated documents are kept (weight ``undated_weight``) or rejected as ``undated``.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from llmpipe.curation.scored import Decision
from llmpipe.document import iter_documents, metadata_value

MONTHS = {name: i for i, names in enumerate([
    ("january", "jan", "januar", "jänner"), ("february", "feb", "februar"), ("march", "mar", "märz", "maerz"),
    ("april", "apr"), ("may", "mai"), ("june", "jun", "juni"), ("july", "jul", "juli"),
    ("august", "aug"), ("september", "sep", "sept"), ("october", "oct", "oktober", "okt"),
    ("november", "nov"), ("december", "dec", "dezember", "dez")], start=1) for name in names}
_MONTH = "|".join(sorted(MONTHS, key=len, reverse=True))
_META = re.compile(
    r"<meta\s[^>]*(?:property|name|itemprop)\s*=\s*[\"'](?:article:published_time|og:published_time|"
    r"datePublished|date|pubdate|publishdate|publish-date|dc\.date|dcterms\.date|sailthru\.date)[\"']"
    r"[^>]*content\s*=\s*[\"']([^\"']+)[\"']"
    r"|<meta\s[^>]*content\s*=\s*[\"']([^\"']+)[\"'][^>]*(?:property|name|itemprop)\s*=\s*[\"']"
    r"(?:article:published_time|datePublished|date|pubdate)[\"']"
    r"|<time\s[^>]*datetime\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_TEXT = re.compile(
    r"(?P<iso>\b(?P<y1>\d{4})[-/](?P<m1>\d{1,2})[-/](?P<d1>\d{1,2})\b)"
    r"|(?P<cjk>(?P<y2>\d{4})\s*年\s*(?P<m2>\d{1,2})\s*月\s*(?P<d2>\d{1,2})\s*日)"
    r"|(?P<dmy>\b(?P<d3>\d{1,2})\.?\s+(?P<mon3>" + _MONTH + r")\.?\s+(?P<y3>\d{4})\b)"
    r"|(?P<mdy>\b(?P<mon4>" + _MONTH + r")\.?\s+(?P<d4>\d{1,2})(?:st|nd|rd|th)?,?\s+(?P<y4>\d{4})\b)"
    r"|(?P<dot>\b(?P<d5>\d{1,2})\.(?P<m5>\d{1,2})\.(?P<y5>\d{4})\b)", re.IGNORECASE)
# What every match of _TEXT holds around its year: followed by [-/] and a digit (iso) or by 年 (cjk),
# or preceded by a space (dmy, mdy: "\s+" before the year) or a dot and followed by a boundary. A
# text without any is skipped: one cheap scan instead of _TEXT's five alternatives tried at every
# position (~0.5 ms a document, all of the stage's scoring); where it matches, _TEXT decides as before.
_MAYBE_TEXT_DATE = re.compile(r"[\s.]\d{4}\b|\d{4}(?:[-/]\d|\s*年)")


def parse_value(value: Any) -> dt.date | None:
    """A metadata value as a date: ISO 8601 (date, date-time, ``YYYY-MM``, ``YYYY``) or epoch seconds."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        secs = value / 1000 if value > 1e11 else value  # milliseconds
        try:
            return dt.datetime.fromtimestamp(secs, tz=dt.UTC).date()
        except (OverflowError, OSError, ValueError):
            return None
    if not isinstance(value, str):
        return None
    s = value.strip()
    try:
        return dt.datetime.fromisoformat(s).date()
    except ValueError:
        pass
    m = re.fullmatch(r"(\d{4})(?:-(\d{1,2}))?", s)
    if m:
        return _date(int(m.group(1)), int(m.group(2) or 1), 1)
    m = _TEXT.search(s)
    return _from_match(m) if m else None


def _date(y: int, m: int, d: int) -> dt.date | None:
    try:
        return dt.date(y, m, d)
    except ValueError:
        return None


def _from_match(m: re.Match[str]) -> dt.date | None:
    g = m.groupdict()
    if g["iso"]:
        return _date(int(g["y1"]), int(g["m1"]), int(g["d1"]))
    if g["cjk"]:
        return _date(int(g["y2"]), int(g["m2"]), int(g["d2"]))
    if g["dmy"]:
        return _date(int(g["y3"]), MONTHS[g["mon3"].lower()], int(g["d3"]))
    if g["mdy"]:
        return _date(int(g["y4"]), MONTHS[g["mon4"].lower()], int(g["d4"]))
    return _date(int(g["y5"]), int(g["m5"]), int(g["d5"]))


def date_in_text(text: str, min_year: int, max_date: dt.date | None) -> tuple[dt.date | None, str | None]:
    """(date, "html" | "text") of the first plausible date: HTML publication tags first, then prose."""
    for m in _META.finditer(text):
        d = parse_value(next(v for v in m.groups() if v))
        if d is not None and _plausible(d, min_year, max_date):
            return d, "html"
    if not _MAYBE_TEXT_DATE.search(text):
        return None, None
    for m in _TEXT.finditer(text):
        d = _from_match(m)
        if d is not None and _plausible(d, min_year, max_date):
            return d, "text"
    return None, None


def _plausible(d: dt.date, min_year: int, max_date: dt.date | None) -> bool:
    return d.year >= min_year and (max_date is None or d <= max_date)


def find_date(meta: dict[str, Any], text: str, cfg: Any, mtime: dt.date | None = None
              ) -> tuple[dt.date | None, str | None]:
    """The document's date and where it came from, in the order of trust (``mtime``: its file's, last)."""
    for path in cfg.date_fields:
        d = parse_value(metadata_value(meta, path))
        if d is not None:
            return d, f"metadata:{path}"
    if cfg.from_text:
        d, origin = date_in_text(text, cfg.min_year, cfg.reference_date)
        if d is not None:
            return d, origin
    if mtime is not None:
        return mtime, "mtime"
    return None, None


def file_key(source: str, file: Any) -> str:
    """How a document names its source file: its source and ingest's ``metadata["file"]``."""
    return f"{source}\x00{file}"


def source_mtimes(pipeline: Any) -> dict[str, str]:
    """The modification date (UTC) of every file of the pipeline's sources, by :func:`file_key`.

    The built-in corpus is skipped: its files are written when first used, so their dates say nothing.
    """
    from pathlib import Path

    from llmpipe.sources import BUILTIN_PREFIX, source_files

    state = Path(pipeline.state_dir)
    state = state if state.is_absolute() else Path.cwd() / state
    out = {}
    for src in pipeline.sources:
        if src.path.startswith(BUILTIN_PREFIX):
            continue
        for path, _fmt, rel in source_files(src, pipeline.base_dir(), state):
            stamp = _modified(path)
            if stamp is not None:
                out[file_key(src.name, rel)] = stamp.isoformat()
    return out


def _modified(path: Any) -> dt.date | None:
    """A local file's mtime, or a URL file's modified time as its filesystem reports it (None where
    it keeps none: the file's documents are then dated by their metadata and text only)."""
    if not isinstance(path, str):
        return dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.timezone.utc).date()
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    try:
        stamp = fs.modified(p)
    except (NotImplementedError, KeyError):
        return None
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc).date()


def score_shard(shard: str, payload: tuple[Any, dict[str, str]]) -> list[dict[str, Any]]:
    """Per document: ``{"date", "origin", "age_days"}`` (None where undated)."""
    cfg, mtimes = payload
    out = []
    for doc in iter_documents(shard):
        stamp = mtimes.get(file_key(doc.source, doc.metadata.get("file")))
        d, origin = find_date(doc.metadata, doc.text, cfg, dt.date.fromisoformat(stamp) if stamp else None)
        age = (cfg.reference_date - d).days if d is not None and cfg.reference_date is not None else None
        out.append({"date": d.isoformat() if d else None, "origin": origin, "age_days": age})
    return out


def decide(s: dict[str, Any], cfg: Any) -> Decision:
    """Stale or undated per the config; the recency weight in metadata when a half-life is set."""
    meta: dict[str, Any] = {}
    if s["date"] is None:
        if cfg.half_life_days:
            meta["recency_weight"] = cfg.undated_weight
        return Decision(None if cfg.undated == "keep" else "undated", meta=meta)
    age = s["age_days"]
    if cfg.half_life_days and age is not None:
        meta["recency_weight"] = round(0.5 ** (max(age, 0) / cfg.half_life_days), 6)
    if cfg.max_age_days is not None and age is not None and age > cfg.max_age_days:
        return Decision("stale", meta=meta)
    return Decision(None, meta=meta)
