"""The Arrow fast path of ingest builds ids and metadata column-wise: it must write the very bytes of
the line loop, or decline. And the one-read scan of a source must agree with a plain hash and count."""

import hashlib
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from llmpipe.ingest import chunk_bounds, fast_jsonl, ingest_file, scan_file
from tests.conftest import write_jsonl
from tests.fixtures.ingest_jobs import ingest_job

CFG = {"normalization": "NFC", "strip_control": True, "min_chars": 1, "max_docs_per_shard": 7}


def _both(tmp_path: Path, recs: list, id_field: str | None = None, chunk: bool = False,
          **cfg) -> tuple[dict | None, dict]:
    """(fast path's stats or None, line loop's stats); where the fast path ran, the same shard bytes."""
    f = write_jsonl(tmp_path / "x.jsonl", recs)
    job = ingest_job(f, id_field=id_field, chunk=chunk_bounds(f, 2)[1] if chunk else None, **{**CFG, **cfg})
    fast = fast_jsonl(job, tmp_path / "fast")
    slow = ingest_file(replace(job, fast=False), tmp_path / "slow")
    if fast is not None:
        names = sorted(p.name for p in (tmp_path / "slow" / "shards").iterdir())
        assert sorted(p.name for p in (tmp_path / "fast" / "shards").iterdir()) == names
        for name in names:
            fast_bytes = (tmp_path / "fast" / "shards" / name).read_bytes()
            assert fast_bytes == (tmp_path / "slow" / "shards" / name).read_bytes()
        assert fast["ingested"] == slow["ingested"]
    return fast, slow


@pytest.mark.parametrize(("id_field", "own", "orjson"),
                         [(None, False, True), ("s", True, True), ("i", False, True), ("b", True, True),
                          ("s", True, False)])
def test_fast_path_matches_the_line_loop_on_tricky_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, id_field: str | None, own: bool, orjson: bool,
) -> None:
    if not orjson:  # orjson is optional: without it metadata is json.dumps's (with spaces)
        import llmpipe.document
        import llmpipe.ingest

        monkeypatch.setattr(llmpipe.document, "_orjson", None)
        monkeypatch.setattr(llmpipe.ingest, "_orjson", None)
    rng = random.Random(7)
    alphabet = ["a", "é", "e\u0301", '"', "\\", "\n", "\r\n", "\r", "\x07", "\x1f", "\x7f", "\x85", "\u2028",
                "😀", "ﬁ", " ", "\t", ","]

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))

    recs: list = []
    for i in range(60):
        r = {"text": "t" + text(), "s": text(), "i": rng.randint(-10**12, 10**12), "b": i % 3 == 0,
             "f": rng.choice([1.5, 0.1, 1e-7, 3e20, 1.0])}
        if own:  # a record's own file/loc fields win; orig_id comes from id_field
            r.update(file=text(), loc=i, orig_id="theirs")
        recs.append(json.dumps(r) if i % 4 == 0 else r)  # some lines ASCII-escaped (\u00e9), others UTF-8
    fast, slow = _both(tmp_path, recs, id_field, chunk=True)
    assert fast is not None and slow["ingested"] > 20


def test_fast_path_skips_normalization_only_for_ascii(tmp_path: Path) -> None:
    recs = [json.dumps({"text": f"plain ascii {i}"}) for i in range(5)]
    recs.append(json.dumps({"text": "ﬁ café\u0301"}))
    fast, _ = _both(tmp_path, recs, normalization="NFKC")
    assert fast is not None


def test_fast_path_declines_an_int_in_a_float_column(tmp_path: Path) -> None:
    fast, slow = _both(tmp_path, [{"text": "a", "f": 1.5}, {"text": "b", "f": 2}, {"text": "c", "f": 2.5}])
    assert fast is None and slow["ingested"] == 3
    fast, _ = _both(tmp_path, [{"text": "a", "f": 1.5}, {"text": "b", "f": 2.0}, {"text": "c", "f": 2.5}])
    assert fast is not None


def test_fast_path_declines_what_min_chars_quarantines(tmp_path: Path) -> None:
    recs = [{"text": "ab"}, {"text": "a  "}, {"text": "\u3000"}, {"text": "abc"}]
    assert _both(tmp_path, recs, min_chars=2)[0] is None
    assert _both(tmp_path, [{"text": "x"}, {"text": " \u3000 "}, {"text": "y"}])[0] is None


def test_scan_file_is_one_read_of_hash_and_chunk_bounds(tmp_path: Path) -> None:
    rng = random.Random(3)
    f = tmp_path / "lines.txt"
    for _ in range(200):
        data = bytes(rng.choice(b"\nab") for _ in range(rng.choice([0, 1, 5, 40, 300])))
        f.write_bytes(data)
        n = rng.randint(1, 9)
        digest, bounds = scan_file(f, n, block=rng.choice([1, 3, 64, 1 << 20]))
        assert digest == hashlib.sha256(data).hexdigest()
        assert bounds == chunk_bounds(f, n)
        cuts = [0] + [b[1] for b in bounds]  # contiguous ranges that cover the file
        assert [b[:2] for b in bounds] == [list(p) for p in zip(cuts, cuts[1:], strict=False)]
        assert cuts[-1] == len(data)
        for start, end, first, newlines in bounds:
            assert data[start:end].count(b"\n") == newlines and data[:start].count(b"\n") + 1 == first
            assert start == 0 or data[start - 1:start] == b"\n"
