"""Instruction and preference records through curation: the curation stages' filters, dedup and
decontamination, every row ending kept or rejected with a reason, the funnel counted from the files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from llmpipe.posttrain import curate, data
from llmpipe.posttrain.config import PreferenceConfig, SftConfig
from tests.conftest import write_jsonl

LONG = ("The committee met on a rainy Thursday to review the annual budget, discuss the new library "
        "wing, and agree on a schedule for the repairs to the old bridge over the river before winter")


def _run(tmp_path: Path, kind: str, sources: list[str], cfg: object) -> tuple[dict, list[dict]]:
    records, bad = data.read_records(sources, tmp_path, kind, quarantine=cfg.curation.bad_records == "quarantine")
    kept, rejected, pii = curate.curate(records, bad, cfg.curation, cfg.decontaminate_ngram)
    funnel = curate.write(tmp_path / "out", len(records) + len(bad), kept, rejected, pii, base=tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "out" / "curation" / "rejected.jsonl").read_text().splitlines()]
    return funnel, rows


def test_the_builtin_sets_mostly_pass(tmp_path: Path) -> None:
    """The chat defaults (langid from 10 characters above 0.3, no Gopher length rules) keep the tiny
    multilingual sets: one instruction pair of 320 is rejected (lid.176 is unsure of a 38-character pair)."""
    f1, rows = _run(tmp_path, "instructions", [data.BUILTIN_INSTRUCTIONS], SftConfig())
    assert f1["in"] == 320 and f1["kept"] >= 316 and set(f1["rejected"]) <= {"low_lang_score"}
    f2, _ = _run(tmp_path, "preferences", [data.BUILTIN_PREFERENCES], PreferenceConfig())
    assert f2["in"] == 320 and f2["kept"] >= 316
    assert all(r["where"].startswith("builtin:instructions#") for r in rows)


def test_planted_junk_is_rejected_by_reason_and_the_funnel_adds_up(tmp_path: Path) -> None:
    good = {"prompt": "Tell me about the meeting, please.", "response": LONG + "."}
    lines = [
        json.dumps(good),
        json.dumps({"prompt": "What happened then?", "response": "It was a good day for everyone in town."}),
        json.dumps(good),  # exact repeat
        json.dumps({**good, "response": LONG + ", as planned."}),  # near repeat
        json.dumps({"prompt": "Say something.", "response": "What a load of shit, honestly, my friend."}),
        json.dumps({"prompt": "zzkq pvxw tlrm", "response": "qqxz fvbn ghjk wwpl"}),  # lid.176: ca, 0.22
        json.dumps({"prompt": "List the days.", "response": "Monday, Tuesday, Wednesday, Thursday, Friday, "
                    "Saturday and Sunday."}),  # a tiny_cloze item
        json.dumps({"prompt": "Where do I write?", "response": "Write to jane.doe@example.com about the schedule."}),
        json.dumps({"prompt": "missing its response"}),
        json.dumps({"prompt": "wrong type", "response": 7}),
        "{not json",
        json.dumps(["a list"]),
    ]
    (tmp_path / "i.jsonl").write_text("\n".join(lines) + "\n")
    cfg = SftConfig(curation={"bad_records": "quarantine"})
    funnel, rows = _run(tmp_path, "instructions", ["i.jsonl"], cfg)
    assert funnel["in"] == len(lines) and funnel["kept"] == 3
    assert funnel["rejected"] == {"blocklist": 1, "contaminated": 1, "duplicate": 1, "error:bad_record": 4,
                                  "low_lang_score": 1, "near_duplicate": 1}
    assert funnel["quarantined"] == 4 and funnel["pii_redactions"] == {"email": 1}
    where = {r["where"].rsplit(":", 1)[1]: r["reason"] for r in rows}
    assert where == {"3": "duplicate", "4": "near_duplicate", "5": "blocklist", "6": "low_lang_score",
                     "7": "contaminated", "9": "error:bad_record", "10": "error:bad_record",
                     "11": "error:bad_record", "12": "error:bad_record"}
    assert "key 'response' must be a non-empty string" in next(r["error"] for r in rows if r["where"].endswith(":10"))
    kept = [json.loads(x) for x in (tmp_path / "out" / "curation" / "kept.jsonl").read_text().splitlines()]
    assert [k["where"] for k in kept] == ["i.jsonl:1", "i.jsonl:2", "i.jsonl:8"]  # relative to the config's folder
    assert "jane.doe@example.com" not in kept[2]["record"]["response"]  # redacted in its own field
    assert kept[2]["record"]["prompt"] == [{"role": "user", "content": "Where do I write?"}]
    saved = json.loads((tmp_path / "out" / "curation" / "funnel.json").read_text())
    assert saved["in"] == saved["kept"] + sum(saved["rejected"].values())


def test_a_bad_row_is_an_error_naming_file_and_line_by_default(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a"}])
    with pytest.raises(data.PostTrainDataError, match=r"p\.jsonl:2: key 'rejected' must be a non-empty string"):
        _run(tmp_path, "preferences", ["p.jsonl"], PreferenceConfig())
    (tmp_path / "q.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{oops\n')
    with pytest.raises(data.PostTrainDataError, match=r"q\.jsonl:2: invalid JSON"):
        _run(tmp_path, "preferences", ["q.jsonl"], PreferenceConfig())


def test_preference_dedup_looks_at_prompt_chosen_and_rejected(tmp_path: Path) -> None:
    rec = {"prompt": "Tell me about the meeting, please.", "chosen": LONG + ".", "rejected": "No idea, sorry."}
    write_jsonl(tmp_path / "p.jsonl", [rec, {**rec, "rejected": "I do not want to talk about it."}, rec])
    funnel, rows = _run(tmp_path, "preferences", ["p.jsonl"], PreferenceConfig())
    assert funnel["kept"] == 2 and Counter(r["reason"] for r in rows) == {"duplicate": 1}
