"""The ``entities`` stage in the plain-Python DAG: spans in metadata, counts per label in the common funnel,
the most frequent entities per label, person names redacted like e-mails when asked, off by default."""

from __future__ import annotations

import json
from pathlib import Path

from llmpipe.config import load_config
from llmpipe.curation.entities.spans import check_spans
from llmpipe.dag import run_pipeline
from llmpipe.document import read_shard, shard_paths

DOCS = [
    "yesterday Alice Martin met the mayor in the city hall . On 2024-03-05 she paid $300 for 12 kg of apples "
    "and wrote to alice@example.org about it.",
    "the report was written by Bruno Okafor last week . It says prices rose 12% in Berlin, see https://example.com.",
    "we called Alice Martin about the new budget . the river was quiet and the park was empty .",
    "2024年3月5日下午3点，李明在北京大学花了500万元，增长了15%。我们都很高兴，也很感谢大家的帮助和支持。",
]


def _config(tmp: Path, entities: dict) -> object:
    src = tmp / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in DOCS))
    (tmp / "g.tsv").write_text("Berlin\tLOC\n李明\tPER\n北京大学\tORG\n", encoding="utf-8")
    return load_config(data={
        "name": "ent", "store": str(tmp / "store"), "state_dir": str(tmp / "state"),
        "sources": [{"name": "web", "path": str(src), "format": "jsonl"}],
        "executor": {"kind": "local", "workers": 1},
        "langid": {"mode": "tag"}, "quality": {"filters": []}, "safety": {"filters": ["pii"]},
        "entities": entities,
    })


def _final(run: object) -> list:
    return [d for p in shard_paths(Path(run.path)) for d in read_shard(p)]


def test_stage_tags_counts_and_redacts(tmp_path: Path, tiny_ner_dir: Path) -> None:
    cfg = _config(tmp_path, {"enabled": True, "recognizers": {"en": ["rules", "ner"], "*": ["rules"]},
                             "rules": {"gazetteers": [str(tmp_path / "g.tsv")]},
                             "ner": {"model": str(tiny_ner_dir)}, "redact": ["PER"], "top_k": 3})
    runs = {r.stage: r for r in run_pipeline(cfg, until="entities")}
    st, out = runs["entities"].stats, Path(runs["entities"].path)
    assert st["docs_in"] == st["docs_kept"] == len(DOCS) and st["rejected"] == {}  # every document accounted for
    funnel = json.loads((out / "funnel.json").read_text())
    assert funnel["in"] == funnel["kept"] == len(DOCS)
    # safety redacted the e-mail first (<EMAIL>); person names were redacted by the entities stage
    assert funnel["stats"]["pii"] == {"PER": 4}
    labels = funnel["stats"]["entities"]
    assert labels == {"DATE": 2, "LOC": 1, "MONEY": 2, "ORG": 1, "PER": 4, "PERCENT": 2, "QUANTITY": 1, "TIME": 1,
                      "URL": 1}
    report = json.loads((out / "entities.json").read_text())
    assert report["labels"] == labels
    assert report["top"]["PER"] == [{"text": "Alice Martin", "count": 2}, {"text": "Bruno Okafor", "count": 1},
                                    {"text": "李明", "count": 1}]
    docs = _final(runs["entities"])
    for d in docs:
        check_spans(d.text, d.metadata["entities"], d.id)  # spans shifted past the placeholders
        assert all(s["label"] != "PER" for s in d.metadata["entities"])
    first = next(d for d in docs if "mayor" in d.text)
    assert first.text.startswith("yesterday <PER> met") and first.metadata["pii"] == {"PER": 1, "email": 1}
    assert (out / "funnel.png").stat().st_size > 1000


def test_stage_off_by_default_passes_through(tmp_path: Path) -> None:
    runs = {r.stage: r for r in run_pipeline(_config(tmp_path, {}), until="entities")}
    assert runs["entities"].stats == {"enabled": False, "docs_in": len(DOCS), "docs_kept": len(DOCS), "shards": 1}
    out, prev = Path(runs["entities"].path), Path(runs["safety"].path)
    for a, b in zip(shard_paths(out), shard_paths(prev), strict=True):
        assert a.read_bytes() == b.read_bytes()
    assert all("entities" not in d.metadata for d in _final(runs["entities"]))
