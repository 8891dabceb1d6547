"""Every curation stage writes the one funnel (llmpipe.curation.funnel): the same keys, a chart, sums that hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpipe.config import load_config
from llmpipe.curation.funnel import KEYS, OPTIONAL_KEYS, check_funnel, report_funnel, write_funnel
from llmpipe.dag import run_pipeline
from llmpipe.document import input_shards, read_shard, rejected_paths, shard_paths
from tests.fixtures.curation_docs import GOOD_EN

CURATION = ("langid", "quality", "safety", "entities", "dedup", "augment")
PNG = b"\x89PNG\r\n\x1a\n"


def _corpus(tmp: Path) -> None:
    texts = [GOOD_EN, GOOD_EN, GOOD_EN + "\nA second paragraph makes this one a different document entirely.",
             "short", "Der Ausschuss wird seinen Abschlussbericht zur Klimapolitik nächste Woche veröffentlichen."]
    (tmp / "src").mkdir(parents=True)
    (tmp / "src" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _config(tmp: Path) -> object:
    return load_config(data={
        "name": "funnel", "store": str(tmp / "store"), "state_dir": str(tmp / "state"),
        "sources": [{"name": "web", "path": str(tmp / "src"), "format": "jsonl"}],
        "executor": {"kind": "local", "workers": 1},
        "langid": {"languages": ["en"]},
        "augment": {"enabled": True, "seed": 0, "operators": [{"type": "restructure", "fraction": 1.0}]},
    })


def _rows(paths: list[Path]) -> int:
    return sum(len(read_shard(p)) for p in paths)


def test_every_curation_stage_writes_the_same_funnel(tmp_path: Path) -> None:
    _corpus(tmp_path)
    runs = {r.stage: r for r in run_pipeline(_config(tmp_path), until="augment")}
    upstream = {"langid": "ingest", "quality": "langid", "safety": "quality", "entities": "safety", "dedup": "entities",
                "augment": "dedup"}
    for name in CURATION:
        out = Path(runs[name].path)
        funnel = json.loads((out / "funnel.json").read_text())
        assert set(KEYS) <= set(funnel) <= set(KEYS) | set(OPTIONAL_KEYS), (name, sorted(funnel))
        check_funnel(funnel, where=name)  # in == kept + sum(rejected); out == kept + sum(added)
        assert funnel["in"] == funnel["kept"] + sum(funnel["rejected"].values())
        assert funnel["in"] == _rows([s.path for s in input_shards(runs[upstream[name]].path)])
        assert (out / "funnel.png").read_bytes()[:8] == PNG, name
        if name != "augment":
            assert funnel["kept"] == _rows(shard_paths(out)), name
            assert sum(funnel["rejected"].values()) == _rows(rejected_paths(out)), name
    dedup = json.loads((Path(runs["dedup"].path) / "funnel.json").read_text())
    # GOOD_EN twice (exact), and once more with one added sentence (near)
    assert dedup["rejected"] == {"exact_duplicate": 1, "near_duplicate": 1}
    assert dedup["filters"] == {"exact": {"in": dedup["in"], "out": dedup["in"] - 1},
                                "near": {"in": dedup["in"] - 1, "out": dedup["kept"]}}
    aug = json.loads((Path(runs["augment"].path) / "funnel.json").read_text())
    assert aug["kept"] == aug["in"] and aug["rejected"] == {}
    assert list(aug["added"]) == ["restructure"] and aug["added"]["restructure"] >= 1
    assert aug["out"] == _rows(shard_paths(runs["augment"].path)) == aug["in"] + aug["added"]["restructure"]


def test_funnel_png_is_the_same_bytes_for_the_same_funnel(tmp_path: Path) -> None:
    funnel = {"in": 5, "kept": 3, "rejected": {"near_duplicate": 2}, "filters": {}, "added": {"syn": 4}, "out": 7}
    _, a = write_funnel(tmp_path / "a", funnel, "t")
    _, b = write_funnel(tmp_path / "b", funnel, "t")
    assert a.read_bytes() == b.read_bytes() and a.read_bytes()[:8] == PNG
    assert b"matplotlib" not in a.read_bytes()


class _Ctx:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.reports: list[tuple[str, object]] = []

    def report_table(self, key: str, title: str, rows: list[dict]) -> None:
        self.reports.append((key, rows))

    def report_image(self, key: str, title: str, path: Path) -> None:
        self.reports.append((key, path))


def test_report_funnel_refuses_a_funnel_that_does_not_add_up(tmp_path: Path) -> None:
    ctx = _Ctx(tmp_path)
    with pytest.raises(RuntimeError, match="augment: funnel does not add up: out=9"):
        report_funnel(ctx, "augment", {"in": 2, "kept": 2, "rejected": {}, "filters": {}, "added": {"x": 1},
                                       "out": 9})
    with pytest.raises(ValueError, match="dedup: funnel keys: missing \\['filters'\\], unknown \\['docs_in'\\]"):
        report_funnel(ctx, "dedup", {"in": 1, "kept": 1, "rejected": {}, "docs_in": 1})
    report_funnel(ctx, "dedup", {"in": 3, "kept": 1, "rejected": {"exact_duplicate": 2}, "filters": {}})
    assert [k for k, _ in ctx.reports] == ["dedup-funnel", "dedup-funnel-chart"]
    assert ctx.reports[0][1][-1] == {"step": "kept", "docs": 1, "share": 0.3333}
