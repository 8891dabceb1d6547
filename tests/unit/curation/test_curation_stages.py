"""The langid -> quality -> safety stages through the plain-Python DAG: funnels add up, files are
written, bad input never crashes, and a refresh that adds a shard only processes the new shard."""

from __future__ import annotations

import json
from pathlib import Path

from llmpipe.config import load_config
from llmpipe.dag import run_pipeline
from llmpipe.document import read_shard, shard_paths
from tests.fixtures.curation_docs import GOOD_EN

ZH = ("今天的天气很好，我们在公园里散步。孩子们在草地上玩耍，老人们在树下下棋。中午我们找了一家小饭馆吃饭，"
      "菜的味道很不错。下午我们去了博物馆，看了很多有意思的展品。晚上回家以后，大家都觉得这一天过得很充实。"
      "明天我们还想去海边看看日出。")


def _write_jsonl(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))


def _config(tmp: Path) -> object:
    return load_config(data={
        "name": "cur", "store": str(tmp / "store"), "state_dir": str(tmp / "state"),
        "sources": [{"name": "web", "path": str(tmp / "src"), "format": "jsonl"}],
        "executor": {"kind": "local", "workers": 1},
        "langid": {"languages": ["en", "zh"], "keep_code": False},  # the "code" reason on the funnel
    })


def _docs(tmp: Path) -> list[str]:
    para = GOOD_EN.replace("\n", " ")
    return [
        GOOD_EN,
        GOOD_EN + "\nWrite to jane.roe@example.org or call (415) 555-2671 for details.",
        GOOD_EN + "\nThis page is full of shit and nothing else, says the angry reader.",
        ZH,
        "Der Ausschuss wird seinen Abschlussbericht zur Klimapolitik nächste Woche veröffentlichen.",
        "short",
        "lorem market river window " * 30,
        "import os\nimport sys\n\ndef main(argv):\n    x = os.getcwd()\n    return x\n",
        "".join(chr(c) for c in range(33, 2000)) * 3,  # binary-ish junk, every script at once
        "Mixed 混合 scripts Смесь mélange 混ざった " * 40,
        (para + "\n") * 2 + GOOD_EN,  # repeated
        para + " " + ("The end of the document is here and it goes on. " * 200_000),  # ~10 MB, one line
    ]


def test_stages_funnels_add_up_and_refresh_touches_only_new_shards(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "src" / "a.jsonl", _docs(tmp_path))
    runs = {r.stage: r for r in run_pipeline(_config(tmp_path), until="safety")}
    # coherence and expertise (off: their input passes through) sit between quality and safety
    assert [s for s in runs] == ["ingest", "langid", "quality", "coherence", "expertise", "safety"]
    prev_kept = runs["ingest"].stats["ingested"]
    for name in ("langid", "quality", "safety"):
        st, out = runs[name].stats, Path(runs[name].path)
        assert st["docs_in"] == prev_kept
        assert st["docs_in"] == st["docs_kept"] + sum(st["rejected"].values())
        funnel = json.loads((out / "funnel.json").read_text())
        assert funnel["in"] == st["docs_in"] and (out / "funnel.png").stat().st_size > 1000
        kept = sum(len(read_shard(p)) for p in shard_paths(out))
        rejected = sum(len(read_shard(p)) for p in sorted((out / "rejected").glob("*.parquet")))
        assert kept == st["docs_kept"] and rejected == st["docs_in"] - kept
        prev_kept = st["docs_kept"]
    assert runs["langid"].stats["rejected"].keys() >= {"too_short", "lang_not_kept", "code"}
    assert runs["quality"].stats["rejected"].get("gopher_long_doc") == 1
    assert runs["safety"].stats["rejected"] == {"blocklist": 1}
    assert runs["safety"].stats["filter_stats"] == {"pii": {"email": 1, "phone": 1}}
    final = [d for p in shard_paths(Path(runs["safety"].path)) for d in read_shard(p)]
    assert {d.metadata["lang"] for d in final} == {"en", "zh"}
    assert any("<EMAIL>" in d.text and "<PHONE>" in d.text for d in final)

    # nightly refresh: one new file -> one new shard; the old shard comes from the shard cache
    _write_jsonl(tmp_path / "src" / "b.jsonl", [GOOD_EN.replace("Tuesday", "Friday")])
    runs2 = {r.stage: r for r in run_pipeline(_config(tmp_path), until="safety")}
    for name in ("langid", "quality", "safety"):
        assert runs2[name].ran and runs2[name].stats["shards"] == 2
        assert runs2[name].stats["shards_cached"] == 1
    assert runs2["safety"].stats["docs_kept"] == runs["safety"].stats["docs_kept"] + 1


class _Broken:
    """A quality filter that raises on every document (a bug, or a missing resource at run time)."""

    name = "broken"

    def filter_batch(self, docs: list) -> list:
        raise RuntimeError("the model file went away")

    def filter(self, doc: object) -> bool:
        raise RuntimeError("the model file went away")


def test_a_filter_raising_on_every_document_fails_the_stage(tmp_path: Path, monkeypatch) -> None:
    """Each error is one document's quarantine, but a stage whose filter raised on every document had
    'succeeded' with them all rejected as error:<Type>. Past quality.max_error_share it fails."""
    import pytest

    from llmpipe.config import ConfigError
    from llmpipe.curation import stages
    from llmpipe.curation.config import QualityConfig
    from llmpipe.dag import StageFailed

    _write_jsonl(tmp_path / "src" / "a.jsonl", [GOOD_EN, GOOD_EN.replace("Tuesday", "Monday"), ZH])
    monkeypatch.setitem(stages.BUILDERS, "quality", (QualityConfig, lambda cfg: [_Broken()]))
    with pytest.raises(StageFailed, match=r"3 of 3 documents \(100.0%\) hit a filter error \(error:RuntimeError "
                                          r"x3\), more than quality.max_error_share = 0.01; the first: broken: "
                                          r"RuntimeError: the model file went away"):
        run_pipeline(_config(tmp_path), until="quality")
    cfg = _config(tmp_path)
    cfg.quality.max_error_share = 1.0
    runs = {r.stage: r for r in run_pipeline(cfg, until="quality")}
    assert runs["quality"].stats["rejected"] == {"error:RuntimeError": 3}
    with pytest.raises(ConfigError, match="quality.max_error_share"):
        load_config(data={"sources": [{"name": "s", "path": "x"}], "quality": {"max_error_share": 1.5}})
