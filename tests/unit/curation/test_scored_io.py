"""The dimension stages' shard IO (``llmpipe.curation.scored``): the Arrow-column write step keeps every row
as it was (only the metadata gains the scores), scores files round-trip, ``iter_rows`` reads what
``iter_documents`` reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq

from llmpipe.curation.scored import Decision, _dump_scores, _read_scores, _write_job
from llmpipe.document import REJECTED, SHARDS, Document, iter_documents, iter_rows, read_shard, write_shard


def _docs() -> list[Document]:
    return [Document("a", "first text ✓", "web", {"lang": "en", "scores": {"quality": {"words": 3}}}),
            Document("b", "zweiter Text", "books", {"lang": "de", "big": 2**70}),  # json, not orjson, writes it
            Document("c", "第三个文本。", "wiki", {}),
            Document("d", "", "web", {"lang": "en", "nested": {"x": [1, 2]}})]


def test_write_job_keeps_every_row_and_adds_the_scores(tmp_path: Path) -> None:
    src = tmp_path / "in" / "part-000.parquet"
    docs = _docs()
    write_shard(src, docs)
    scores = [{"lang": d.metadata.get("lang", "en"), "perplexity": float(i)} for i, d in enumerate(docs)]
    decisions = [Decision(None, scores={"bucket": "head"}), Decision("coherence_tail", scores={"bucket": "tail"}),
                 Decision(None, meta={"recency_weight": 0.5}), Decision("coherence_tail")]
    out = tmp_path / "out"
    funnel = _write_job((str(src), str(out), src.name, "coherence", scores, decisions))
    assert funnel == {"in": 4, "kept": 2, "rejected": {"coherence_tail": 2},
                      "filters": {"coherence": {"in": 4, "out": 2}}}
    kept, rejected = read_shard(out / SHARDS / src.name), read_shard(out / REJECTED / src.name)
    assert [d.id for d in kept] == ["a", "c"] and [d.id for d in rejected] == ["b", "d"]
    by_id = {d.id: d for d in kept + rejected}
    for d, sc, dec in zip(docs, scores, decisions, strict=True):
        got = by_id[d.id]
        assert (got.text, got.source) == (d.text, d.source)
        want = {**d.metadata, **dec.meta}
        want["scores"] = {**d.metadata.get("scores", {}), "coherence": {**sc, **dec.scores}}
        if dec.reason:
            want.update(reject_reason=dec.reason, rejected_by="coherence")
        assert got.metadata == want
    assert by_id["b"].metadata["big"] == 2**70  # an int past 64 bits survives the rewrite exactly
    text_col = pq.ParquetFile(out / SHARDS / src.name).metadata.row_group(0).column(1)
    assert text_col.path_in_schema == "text" and "RLE_DICTIONARY" not in text_col.encodings


def test_scores_files_round_trip_and_nan_is_null(tmp_path: Path) -> None:
    scores = [{"b": 1.5, "a": None, "n": 3}, {"big": 2**70}, {"x": math.nan}]
    path = tmp_path / "scores.json"
    path.write_bytes(_dump_scores(scores[:1]))
    assert _read_scores(path) == scores[:1] and list(_read_scores(path)[0]) == ["a", "b", "n"]
    path.write_bytes(_dump_scores(scores[:2]))  # orjson cannot write 2**70: json does
    assert _read_scores(path) == scores[:2]
    path.write_bytes(_dump_scores(scores[2:]))
    assert _read_scores(path) == [{"x": None}]  # as the scores stored on the documents read
    path.write_text(json.dumps([{"x": math.nan}]))  # a scores file json wrote (NaN) still reads
    assert math.isnan(_read_scores(path)[0]["x"])


def test_iter_rows_reads_what_iter_documents_reads(tmp_path: Path) -> None:
    path = tmp_path / "s.parquet"
    write_shard(path, _docs())
    rows = list(iter_rows(path, ("text", "metadata", "id"), batch_size=3))
    assert rows == [(d.text, d.metadata, d.id) for d in iter_documents(path)]
    assert list(iter_rows(path, ("source",))) == [(d.source,) for d in _docs()]


def test_the_parent_holds_no_score_per_document(tmp_path: Path) -> None:
    """A dimension stage's parent reads the scores a shard at a time and its workers apply the rule:
    4x the shards (of the same size) add ~0.5 MiB of per-shard bookkeeping to its peak traced
    memory. Holding every score dict and decision, as it did, cost ~0.7 KB a document: +4.0 MiB for
    the 6,000 more documents here."""
    import datetime as dt
    import tracemalloc

    from llmpipe.curation.dimensions_config import TimelinessConfig
    from tests.fixtures.quality_corpus import run_stage, write_upstream

    cfg = TimelinessConfig(enabled=True, reference_date=dt.date(2026, 1, 1), half_life_days=365, max_age_days=3650)
    peaks = {}
    for shards in (4, 16):
        docs = [Document(f"d{i}", f"Posted on {1 + i % 28} March {2000 + i % 25}. Text {i}.", "web", {})
                for i in range(500 * shards)]
        root = tmp_path / str(shards)
        write_upstream(docs, root, shards)
        run_stage("timeliness", cfg, docs[:1], tmp_path / "warm", shards=1)  # imports and caches, untraced
        tracemalloc.start()
        try:
            stats, _ = run_stage("timeliness", cfg, docs, root, shards=shards, upstream_written=True)
            peaks[shards] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert stats["docs_in"] == len(docs)
    growth = peaks[16] - peaks[4]
    print(f"peak traced memory {peaks[4] / 2**20:.2f} -> {peaks[16] / 2**20:.2f} MiB")
    assert growth < 1 << 20, f"peak grew {growth / 2**20:.2f} MiB for 6,000 more documents"
