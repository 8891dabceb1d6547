"""The filter framework: batching, reasons, scores beside decisions, quarantine, funnel files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpipe.curation.config import QualityConfig
from llmpipe.curation.filters import (
    Filter,
    FilterChain,
    apply_filters,
    check_funnel,
    merge_funnels,
    write_funnel,
)
from llmpipe.curation.quality import GopherQualityFilter, build_quality_filters, rejudge
from llmpipe.document import Document, read_shard, write_shard
from tests.fixtures.curation_docs import GOOD_EN, doc


class LengthFilter(Filter):
    name = "length"

    def filter(self, d: Document) -> bool | tuple[bool, str]:
        if len(d.text) < 5:
            return False, "too_short"
        return len(d.text) < 100  # plain False: reason defaults to the filter name


class Exploding(Filter):
    name = "explode"

    def filter(self, d: Document) -> bool:
        if "boom" in d.text:
            raise ZeroDivisionError("planted")
        return True


def test_chain_counts_reasons_and_quarantines_only_the_bad_doc() -> None:
    docs = [doc("hi"), doc("a fine text"), doc("x" * 200), doc("boom goes here"), doc("another fine one")]
    chain = FilterChain([LengthFilter(), Exploding()])
    kept, rejected = chain.run_batch(docs)
    assert [d.text for d in kept] == ["a fine text", "another fine one"]
    reasons = {d.text[:4]: d.metadata["reject_reason"] for d in rejected}
    assert reasons == {"hi": "too_short", "xxxx": "length", "boom": "error:ZeroDivisionError"}
    assert "planted" in next(d for d in rejected if d.text.startswith("boom")).metadata["error"]
    f = chain.funnel()
    assert f["in"] == 5 and f["kept"] == 2
    assert f["rejected"] == {"error:ZeroDivisionError": 1, "length": 1, "too_short": 1}
    assert f["filters"]["length"]["in"] == 5 and f["filters"]["explode"]["in"] == 3
    check_funnel(f)


def test_duplicate_filter_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        FilterChain([LengthFilter(), LengthFilter()])


def test_apply_filters_writes_kept_and_rejected_with_scores(tmp_path: Path) -> None:
    docs = [doc(GOOD_EN), doc("too few words here."), doc(""), doc("boom " + GOOD_EN)]
    src = tmp_path / "in" / "s.parquet"
    write_shard(src, docs)
    funnel = apply_filters(src, tmp_path / "out/shards/s.parquet", tmp_path / "out/rejected/s.parquet",
                           build_quality_filters(QualityConfig()) + [Exploding()], batch_size=2)
    kept = read_shard(tmp_path / "out/shards/s.parquet")
    rej = read_shard(tmp_path / "out/rejected/s.parquet")
    assert funnel["in"] == 4 == len(kept) + len(rej)
    assert funnel["kept"] == len(kept) == 1
    assert sum(funnel["rejected"].values()) == len(rej) == 3
    for d in rej:  # every rejected doc says why and carries the scores of the filter that dropped it
        assert d.metadata["reject_reason"]
        if not d.metadata["reject_reason"].startswith("error:"):
            assert d.metadata["rejected_by"] in d.metadata["scores"]
    assert set(kept[0].metadata["scores"]) == {"gopher_quality", "gopher_repetition", "c4", "fineweb"}


def test_thresholds_can_be_reapplied_from_stored_scores(tmp_path: Path) -> None:
    d = doc(GOOD_EN)
    assert GopherQualityFilter().filter(d) is True
    assert rejudge([GopherQualityFilter()], d) is None
    strict = QualityConfig.model_validate({"gopher_quality": {"min_doc_words": 500}}).gopher_quality
    # the same stored numbers, a new threshold: rejected without recomputing
    assert rejudge([GopherQualityFilter(strict)], d) == "gopher_short_doc"
    assert GopherQualityFilter(strict).filter(doc(GOOD_EN)) == (False, "gopher_short_doc")


def test_merge_and_write_funnel(tmp_path: Path) -> None:
    a = {"in": 3, "kept": 1, "rejected": {"x": 2}, "filters": {"f": {"in": 3, "out": 1, "seconds": 0.1}}}
    b = {"in": 2, "kept": 1, "rejected": {"x": 1}, "filters": {"f": {"in": 2, "out": 1, "seconds": 0.1}}}
    m = merge_funnels([a, b])
    assert m["in"] == 5 and m["kept"] == 2 and m["rejected"] == {"x": 3} and m["filters"]["f"]["in"] == 5
    js, png = write_funnel(tmp_path, m, "test")
    assert json.loads(js.read_text())["kept"] == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(RuntimeError, match="does not add up"):
        check_funnel({"in": 4, "kept": 1, "rejected": {"x": 2}})
