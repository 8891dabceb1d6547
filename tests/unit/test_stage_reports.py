"""Stats reports: the artifact names the measurements to show, the manifest holds their values."""

from __future__ import annotations

import json
import time
from pathlib import Path

from llmpipe.dag import REPORTS, PlannedStage, execute
from llmpipe.executor import LocalExecutor
from llmpipe.stage import StageContext, StageSpec, stats_rows
from llmpipe.store import ArtifactStore


def _timed(ctx: StageContext) -> dict[str, float | dict[str, int]]:
    """A stage whose result is a file and whose speed is a stat, as every compute stage does it."""
    t0 = time.perf_counter()
    (ctx.out / "result.txt").write_text("42\n")
    ctx.report_stats("speed", "Speed", ["seconds", "histogram", "absent"])
    return {"seconds": time.perf_counter() - t0, "histogram": {"4": 2, "1": 1}}


def test_reports_json_names_the_stats_and_the_table_reads_the_manifest(tmp_path: Path) -> None:
    spec = StageSpec(name="timed", version="1", inputs=(), config_field=None, flow="pretrain", fn=_timed)
    store = ArtifactStore(tmp_path / "store")
    art, ran, _ = execute(None, store, PlannedStage(spec, "k" * 64, None, {}), {},  # type: ignore[arg-type]
                          executor=LocalExecutor(1))
    assert ran
    reports = json.loads((art.path / REPORTS).read_text())
    assert reports == [{"kind": "stats", "key": "speed", "title": "Speed",
                        "payload": ["seconds", "histogram", "absent"]}]  # names only: no run's numbers
    rows = stats_rows(art.stats, reports[0]["payload"])
    assert rows[0] == {"metric": "seconds", "value": art.stats["seconds"]}
    assert rows[1] == {"metric": "histogram", "value": '{"1": 1, "4": 2}'}
    assert rows[2] == {"metric": "absent", "value": None}
