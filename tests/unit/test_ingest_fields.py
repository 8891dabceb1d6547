"""Nothing the user gave is lost: nested fields reach the end of curation as they were, a byte order
mark does not cost a record, and a cut compressed file keeps what came before the cut and says where
it stopped."""

from __future__ import annotations

import datetime
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from llmpipe.config import load_config
from llmpipe.dag import run_pipeline
from llmpipe.document import Document, metadata_value, read_shard
from llmpipe.ingest import BOM, IngestJob, fast_jsonl, ingest_file
from llmpipe.pipeline import load_stages
from tests.conftest import write_jsonl
from tests.fixtures.curation_docs import GOOD_EN
from tests.fixtures.ingest_jobs import ingest_job

OTHER_EN = (
    "Farmers in the northern valley began the harvest early this year because of the warm spring.\n"
    "The cooperative hired extra workers and rented two machines from a neighbouring village.\n"
    "Prices at the weekly market stayed stable, although the demand for fresh apples kept rising.\n"
    "Several families opened their orchards to visitors, who could pick fruit and buy cider.\n"
    "The regional newspaper reported that the season was the best one in more than a decade."
)

NESTED = {  # every JSON shape: null, nested lists, unicode, ints beside integral floats, big ints
    "hint_lang": "ja", "dup_of": None, "published": "2024-05-01T08:30:00Z",
    "tags": ["news", ["nested", 1, 1.0, -0.0, None], {"deep": {"deeper": [True, False]}}],
    "score": 0.1, "count": 3, "ratio": 2.0, "huge": 2**70, "tiny": -(2**63) - 1, "exp": 1e300,
    "unicode": "日本語 😀 \u2028 \"quoted\" back\\slash", "empty_obj": {}, "empty_list": [],
}


def _exact(value: object) -> str:
    """A value's JSON with types spelled out: 1 and 1.0 (equal in Python) or 0.0 and -0.0 differ here."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _config(tmp: Path, sources: list[dict], **sections: object) -> object:
    return load_config(data={"name": "fields", "store": str(tmp / "store"), "state_dir": str(tmp / "state"),
                             "sources": sources, "executor": {"kind": "local", "workers": 1}, **sections})


def _docs(path: str | Path, sub: str = "shards") -> list[Document]:
    return [d for p in sorted((Path(path) / sub).glob("*.parquet")) for d in read_shard(p)]


def _arg(path: Path, fmt: str = "jsonl", fast: bool = True) -> IngestJob:
    return ingest_job(path, fmt, fast=fast, max_docs_per_shard=100)


def _quarantine(out: Path) -> list[dict]:
    q = out / "quarantine.jsonl"
    return [json.loads(line) for line in q.read_text().splitlines()] if q.is_file() else []


def test_nested_fields_reach_the_end_of_curation_exactly(tmp_path: Path) -> None:
    links = [{"href": "https://example.org/a", "rel": None}, {"href": "https://example.org/ü"}]
    write_jsonl(tmp_path / "src" / "a.jsonl", [
        {"text": GOOD_EN, "metadata": NESTED, "links": links, "plain": "kept too"},
        {"text": OTHER_EN, "metadata": {"published": "2023-01-02", "dup_of": "x1"}, "links": []},
    ])
    synonyms = {"type": "synonym", "fraction": 1.0, "probability": 0.3}  # every doc gets a child
    cfg = _config(tmp_path, [{"name": "web", "path": str(tmp_path / "src")}], langid={"languages": ["en"]},
                  augment={"enabled": True, "operators": [synonyms]})
    runs = {r.stage: r for r in run_pipeline(cfg, until="augment")}
    order = list(load_stages())
    assert list(runs) == order[: order.index("augment") + 1]  # every curation stage, the dimensions too
    for stage in runs:  # each stage's output carries the record's own fields, unchanged
        docs = _docs(runs[stage].path)
        assert len(docs) >= 2 and any(d.meta("plain") == "kept too" for d in docs), stage
        for d in docs:
            if d.meta("plain") == "kept too":
                assert _exact(d.metadata["metadata"]) == _exact(NESTED) and d.metadata["links"] == links, stage
            else:
                assert d.metadata["metadata"] == {"published": "2023-01-02", "dup_of": "x1"}, stage
                assert d.metadata["links"] == [], stage
    final = _docs(runs["augment"].path)
    children = [d for d in final if d.metadata.get("parent_id")]
    assert children and all("metadata" in d.metadata for d in children)
    first = next(d for d in final if d.text == GOOD_EN)
    assert first.meta("metadata.published") == "2024-05-01T08:30:00Z"  # what a timeliness stage reads
    assert first.meta("links.1.href") == "https://example.org/ü"  # what lineage reads
    assert first.meta("metadata.huge") == 2**70 and isinstance(first.meta("metadata.ratio"), float)
    assert first.meta("metadata.tags.0") == "news" and first.meta("metadata.dup_of", "absent") is None


def test_metadata_value_paths() -> None:
    meta = {"a": {"b": [10, {"c": "x"}]}, "x.y": 1, "n": None}
    assert metadata_value(meta, "a.b.1.c") == "x" and metadata_value(meta, "a.b.-1.c") == "x"
    assert metadata_value(meta, "x.y") == 1 and metadata_value(meta, ("a", "b", 0)) == 10
    assert metadata_value(meta, "n", "default") is None  # a stored null is a value, not an absence
    for missing in ("a.z", "a.b.2", "a.b.c", "a.b.0.c", "zz"):
        assert metadata_value(meta, missing, "default") == "default", missing


def test_parquet_and_save_to_disk_keep_nested_columns(tmp_path: Path) -> None:
    import datasets

    when = datetime.datetime(2024, 5, 1, 8, 30, tzinfo=datetime.timezone.utc)
    table = pa.table({
        "text": ["parquet one", "parquet two"],
        "meta": [{"lang": "ja", "dup_of": None, "tags": ["a", "b"]}, {"lang": None, "dup_of": "p1", "tags": []}],
        "nums": [[1, 2], None], "score": [1.0, 2.5], "count": [3, None], "published": [when, None],
        "raw": [b"bytes \xc3\xa9", b"\xff\x00"], "nan": [float("nan"), float("-inf")],
    })
    pq.write_table(table, tmp_path / "t.parquet")
    datasets.Dataset.from_dict({"text": ["hf one"], "info": [{"url": "https://example.org", "n": [1, 2.5]}],
                                "label": [7]}).save_to_disk(str(tmp_path / "hf"))
    cfg = _config(tmp_path, [{"name": "pq", "path": str(tmp_path / "t.parquet")},
                             {"name": "hf", "path": str(tmp_path / "hf")}])
    (run,) = run_pipeline(cfg, until="ingest")
    assert run.stats["ingested"] == 3 and run.stats["quarantined"] == 0
    docs = {d.text: d.metadata for d in _docs(run.path)}
    one, two = docs["parquet one"], docs["parquet two"]
    assert _exact(one["meta"]) == _exact({"lang": "ja", "dup_of": None, "tags": ["a", "b"]})
    assert _exact(two["meta"]) == _exact({"lang": None, "dup_of": "p1", "tags": []})
    assert (one["nums"], two["nums"], one["count"], two["count"]) == ([1, 2], None, 3, None)
    assert _exact(one["score"]) == "1.0" and _exact(two["score"]) == "2.5"
    assert one["published"] == "2024-05-01T08:30:00+00:00" and two["published"] is None
    assert one["raw"] == "bytes é" and two["raw"] == "/wA="  # not UTF-8: base64
    assert (one["nan"], two["nan"]) == ("NaN", "-Infinity")
    assert one["loc"] == "row 1" and two["loc"] == "row 2"
    hf = docs["hf one"]
    assert _exact(hf["info"]) == _exact({"url": "https://example.org", "n": [1.0, 2.5]}) and hf["label"] == 7


def test_byte_order_marks_are_stripped_everywhere(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    lines = [BOM + b'{"text": "first line after a BOM"}', b'{"text": "second"}',
             BOM + b'{"text": "a BOM in the middle", "k": 1}', b'{"text": "last \xef\xbb\xbf inside keeps it"}']
    body = b"\n".join(lines) + b"\n"
    (src / "a.jsonl").write_bytes(body)
    (src / "b.jsonl.gz").write_bytes(gzip.compress(body))
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    (src / "d.txt").write_bytes(BOM + b"a whole text file\nwith a BOM\n")
    (tmp_path / "lines.txt").write_bytes(BOM + b"line one\r\n" + BOM + b"line two\r\nline three")
    cfg = _config(tmp_path, [{"name": "mix", "path": str(src)},
                             {"name": "lines", "path": str(tmp_path / "lines.txt"), "format": "text_lines"}])
    (run,) = run_pipeline(cfg, until="ingest")
    assert run.stats["quarantined"] == 0 and run.stats["ingested"] == 3 * 4 + 1 + 3
    texts = sorted(d.text for d in _docs(run.path))
    want = ["first line after a BOM", "second", "a BOM in the middle", "last \ufeff inside keeps it"]
    assert texts == sorted(want * 3 + ["a whole text file\nwith a BOM\n", "line one", "line two", "line three"])
    # the Arrow fast path takes a BOM on the first line (same bytes as the line loop) and leaves the rest
    (tmp_path / "first.jsonl").write_bytes(BOM + b'{"text": "a"}\n{"text": "b"}\n')
    assert fast_jsonl(_arg(tmp_path / "first.jsonl"), tmp_path / "fast") is not None
    ingest_file(_arg(tmp_path / "first.jsonl", fast=False), tmp_path / "slow")
    shard = "shards/p-00000.parquet"
    assert (tmp_path / "fast" / shard).read_bytes() == (tmp_path / "slow" / shard).read_bytes()
    assert fast_jsonl(_arg(src / "a.jsonl"), tmp_path / "fast2") is None


def _records(n: int) -> bytes:
    """JSON lines that compress only so far: a cut in the middle leaves many whole lines before it."""
    import hashlib

    return b"".join(json.dumps({"text": f"record {i} " + hashlib.sha256(str(i).encode()).hexdigest()}).encode()
                    + b"\n" for i in range(1, n + 1))


def test_truncated_gzip_keeps_what_came_before_and_names_the_line(tmp_path: Path) -> None:
    data = gzip.compress(_records(3000))
    cut = data[: len(data) // 2]
    f = tmp_path / "data.jsonl.gz"
    f.write_bytes(cut)
    import zlib

    complete = zlib.decompressobj(wbits=31).decompress(cut).count(b"\n")  # whole lines before the cut
    assert 100 < complete < 3000
    stats = ingest_file(_arg(f), tmp_path / "out")
    assert (stats["read"], stats["ingested"], stats["quarantined"]) == (complete + 1, complete, 1)
    assert _quarantine(tmp_path / "out") == [
        {"where": f"{f}:{complete + 1}", "reason": f"truncated gzip stream after line {complete}"}]
    assert stats["reasons"] == {"truncated gzip stream": 1}
    locs = [int(d.metadata["loc"]) for d in _docs(tmp_path / "out")]
    assert locs == list(range(1, complete + 1))


def test_truncated_and_multi_frame_zstd(tmp_path: Path) -> None:
    zc = zstandard.ZstdCompressor()
    data = zc.compress(_records(3000))
    f = tmp_path / "cut.jsonl.zst"
    f.write_bytes(data[: len(data) // 2])
    partial = zstandard.ZstdDecompressor().stream_reader(f.open("rb")).read()  # ends silently at the cut
    complete = partial.count(b"\n")
    assert 100 < complete < 3000
    stats = ingest_file(_arg(f), tmp_path / "out")
    assert (stats["ingested"], stats["quarantined"]) == (complete, 1)
    assert _quarantine(tmp_path / "out")[0] == {
        "where": f"{f}:{complete + 1}", "reason": f"truncated zstd stream after line {complete}"}
    # two frames one after the other (pzstd, or `cat a.zst b.zst`): both are read
    two = tmp_path / "two.jsonl.zst"
    two.write_bytes(zc.compress(b'{"text": "frame one"}\n') + zc.compress(b'{"text": "frame two"}\n'))
    stats = ingest_file(_arg(two), tmp_path / "two")
    assert stats["ingested"] == 2 and sorted(d.text for d in _docs(tmp_path / "two")) == ["frame one", "frame two"]


def test_corrupt_or_mislabelled_gzip_is_one_quarantined_record(tmp_path: Path) -> None:
    f = tmp_path / "plain.jsonl.gz"
    f.write_bytes(b'{"text": "not compressed at all"}\n')
    stats = ingest_file(_arg(f), tmp_path / "out")
    (q,) = _quarantine(tmp_path / "out")
    assert stats["read"] == 1 and stats["quarantined"] == 1 and q["where"] == f"{f}:1"
    assert q["reason"].startswith("corrupt gzip stream before its first line: BadGzipFile")
    good = bytearray(gzip.compress(_records(3000)))
    good[len(good) // 2] ^= 0xFF  # one flipped byte in the middle of the deflate stream
    bad = tmp_path / "flipped.jsonl.gz"
    bad.write_bytes(bytes(good))
    stats = ingest_file(_arg(bad), tmp_path / "flipped")
    reason = _quarantine(tmp_path / "flipped")[-1]["reason"]
    assert reason.startswith("corrupt gzip stream after line") and stats["ingested"] > 100
    assert stats["read"] == stats["ingested"] + stats["quarantined"]
    text = tmp_path / "cut.txt.gz"  # a declared text file, cut: its one document is quarantined
    whole = gzip.compress(_records(500))
    text.write_bytes(whole[: len(whole) // 2])
    stats = ingest_file(_arg(text, "text"), tmp_path / "text")
    assert (stats["read"], stats["quarantined"]) == (1, 1)
    assert _quarantine(tmp_path / "text")[0]["reason"].startswith("truncated gzip stream after line")
