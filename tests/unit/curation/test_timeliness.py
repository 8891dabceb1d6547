"""Timeliness: a date from each origin (metadata, HTML, prose in en / de / zh), stale and undated
rules, recency weights; the stage key and its decisions do not depend on the machine's clock."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmpipe.curation.dimensions_config import TimelinessConfig
from llmpipe.curation.timeliness import find_date
from llmpipe.document import Document, read_shard, rejected_paths, shard_paths
from tests.conftest import ROOT
from tests.fixtures.quality_corpus import run_stage

REF = dt.date(2026, 1, 1)
CASES = [  # (metadata, text, date, origin)
    ({"date": "2025-06-30"}, "Published 1 March 2001.", "2025-06-30", "metadata:date"),
    ({"metadata": {"date": "2024-02-03T10:00:00Z"}}, "", "2024-02-03", "metadata:metadata.date"),
    ({"published": 1700000000}, "", "2023-11-14", "metadata:published"),
    ({}, '<html><head><meta property="article:published_time" content="2022-05-06T08:00:00+02:00">'
         '</head><body>Updated 2025-01-01</body></html>', "2022-05-06", "html"),
    ({}, '<p>Posted <time datetime="2021-07-08">July 8</time></p>', "2021-07-08", "html"),
    ({}, "The council met on March 4, 2021 to discuss the budget.", "2021-03-04", "text"),
    ({}, "Die Sitzung fand am 4. März 2019 statt.", "2019-03-04", "text"),
    ({}, "会议于2020年3月4日举行。", "2020-03-04", "text"),
    ({}, "Release notes, 2018/12/31: fixes.", "2018-12-31", "text"),
    ({}, "Am 05.06.2017 wurde das Gesetz verabschiedet.", "2017-06-05", "text"),
    ({"date": "not a date"}, "No date here at all, only 1200 words and version 3.11.", None, None),
    ({}, "In 1066 the battle took place on 14 October 1066.", None, None),  # before min_year
    ({}, "The contract ends on 1 January 2031.", None, None),  # after the reference date
]


@pytest.mark.parametrize(("meta", "text", "date", "origin"), CASES)
def test_a_date_from_each_origin(meta: dict, text: str, date: str | None, origin: str | None) -> None:
    d, o = find_date(meta, text, TimelinessConfig(reference_date=REF))
    assert (d.isoformat() if d else None, o) == (date, origin)


def _docs() -> list[Document]:
    return [Document(f"d{i}", text or "plain text", "t", meta) for i, (meta, text, _, _) in enumerate(CASES)]


def test_stale_undated_and_weights(tmp_path: Path) -> None:
    cfg = TimelinessConfig(enabled=True, reference_date=REF, max_age_days=5 * 365, half_life_days=365,
                           undated="drop")
    stats, out = run_stage("timeliness", cfg, _docs(), tmp_path)
    kept = {d.id: d for p in shard_paths(out) for d in read_shard(p)}
    rejected = {d.id: d for p in rejected_paths(out) for d in read_shard(p)}
    assert sorted(kept) == ["d0", "d1", "d2", "d3", "d4", "d5"]
    assert {k: d.metadata["reject_reason"] for k, d in rejected.items()} == {
        "d6": "stale", "d7": "stale", "d8": "stale", "d9": "stale", "d10": "undated", "d11": "undated",
        "d12": "undated"}
    assert stats["docs_in"] == 13 == stats["docs_kept"] + sum(stats["rejected"].values())
    s0 = kept["d0"].metadata["scores"]["timeliness"]
    assert s0 == {"date": "2025-06-30", "origin": "metadata:date", "age_days": 185}
    assert kept["d0"].metadata["recency_weight"] == round(0.5 ** (185 / 365), 6)
    years = json.loads((out / "years.json").read_text())
    assert years["years"]["undated"] == 3 and sum(years["years"].values()) == 13
    # undated kept with a weight of their own
    cfg2 = TimelinessConfig(enabled=True, reference_date=REF, half_life_days=365, undated_weight=0.25)
    _, out2 = run_stage("timeliness", cfg2, _docs(), tmp_path / "keep")
    undated = [d for p in shard_paths(out2) for d in read_shard(p) if d.metadata["scores"]["timeliness"]["date"] is None]
    assert len(undated) == 3 and {d.metadata["recency_weight"] for d in undated} == {0.25}


def test_rules_need_a_fixed_reference_date() -> None:
    with pytest.raises(ValueError, match="need reference_date"):
        TimelinessConfig(enabled=True, max_age_days=30)


SCRIPT = """
import datetime, json, sys
from pathlib import Path
from llmpipe.config import load_config
from llmpipe.dag import plan
from tests.fixtures.quality_corpus import run_stage
from tests.unit.curation.test_timeliness import _docs
root = Path(sys.argv[1])
cfg = load_config(data={"name": "t", "store": str(root / "store"), "state_dir": str(root / "state"),
                        "sources": [{"name": "s", "path": sys.argv[2], "format": "jsonl"}],
                        "timeliness": {"enabled": True, "reference_date": "2026-01-01", "max_age_days": 1000}})
stats, _ = run_stage("timeliness", cfg.timeliness, _docs(), root / "run")
print(json.dumps({"today": datetime.date.today().isoformat(), "key": plan(cfg)["timeliness"].key,
                  "rejected": stats["rejected"]}))
"""


def test_the_clock_does_not_change_the_key(tmp_path: Path) -> None:
    """Two processes whose local dates differ (UTC-12 and UTC+14): the same key and the same decisions."""
    src = tmp_path / "src" / "a.jsonl"
    src.parent.mkdir(parents=True)
    src.write_text("".join(json.dumps({"text": f"{t} " * 3, **m}) + "\n" for m, t, _, _ in CASES if t))
    out = []
    for tz in ("Etc/GMT+12", "Etc/GMT-14"):
        env = {**os.environ, "TZ": tz}
        res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / tz.replace("/", "_")),
                              str(src.parent)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert out[0]["today"] != out[1]["today"]
    assert out[0]["key"] == out[1]["key"] and out[0]["rejected"] == out[1]["rejected"] == {"stale": 7}


def test_the_source_file_date_comes_last(tmp_path: Path) -> None:
    """``file_mtime``: a document with no other date takes its file's modification date (origin ``mtime``)."""
    from llmpipe.config import load_config
    from llmpipe.dag import run_pipeline

    src = tmp_path / "src"
    src.mkdir()
    (src / "old.jsonl").write_text(json.dumps({"text": "No date in this text at all, none."}) + "\n"
                                   + json.dumps({"text": "This one says 4 March 2021 plainly."}) + "\n")
    stamp = dt.datetime(2020, 5, 5, 12, tzinfo=dt.timezone.utc).timestamp()
    os.utime(src / "old.jsonl", (stamp, stamp))
    cfg = load_config(data={
        "name": "t", "store": str(tmp_path / "store"), "state_dir": str(tmp_path / "state"),
        "sources": [{"name": "web", "path": str(src), "format": "jsonl"}], "executor": {"workers": 1},
        "langid": {"mode": "tag"}, "quality": {"filters": []}, "safety": {"filters": []},
        "timeliness": {"enabled": True, "file_mtime": True, "reference_date": "2026-01-01"}})
    runs = {r.stage: r for r in run_pipeline(cfg, until="timeliness")}
    got = sorted((d.metadata["scores"]["timeliness"]["date"], d.metadata["scores"]["timeliness"]["origin"])
                 for p in shard_paths(Path(runs["timeliness"].path)) for d in read_shard(p))
    assert got == [("2020-05-05", "mtime"), ("2021-03-04", "text")]


def test_the_prefilter_never_skips_a_text_date() -> None:
    """``_MAYBE_TEXT_DATE`` only skips texts in which ``_TEXT`` finds nothing: random texts built from
    the pieces dates are made of (digits, months, separators, 年月日, spaces, dots), each checked
    with and without the prefilter."""
    import random

    from llmpipe.curation import timeliness as tl

    rng = random.Random(0)
    pieces = ["2021", "1999", "12345", "3", "04", "-", "/", ".", ",", " ", "\n", "\u00a0", "March", "sept",
              "März", "st", "年", "月", "日", "x", "Page", "(", ")", "2021-03-04", "4 March 2021", "March 4th, 2021",
              "04.03.2021", "2021年3月4日", "Sept. 30 1999", "1999/12/31"]
    seen = 0
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        found = tl._TEXT.search(text) is not None
        seen += found
        assert not found or tl._MAYBE_TEXT_DATE.search(text), text
    assert seen > 500  # the pieces do make dates: the check is not vacuous
