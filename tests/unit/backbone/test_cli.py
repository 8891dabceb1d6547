"""The command line: status, lineage and gc on a real (tiny) store."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.cli import main
from tests.conftest import write_jsonl


@pytest.fixture
def project(workdir: Path) -> Path:
    write_jsonl(workdir / "data" / "a.jsonl", [{"text": f"hello number {i}"} for i in range(5)])
    (workdir / "p.yaml").write_text("sources:\n  - name: web\n    path: data\nrunner:\n  workers: 1\n")
    return workdir


def test_run_status_lineage_gc(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "p.yaml", "--no-prefect", "--until", "ingest"]) == 0
    out = capsys.readouterr().out
    assert "ingest" in out and "ran" in out
    assert main(["status", "p.yaml"]) == 0
    status = capsys.readouterr().out
    ingest_line = next(line for line in status.splitlines() if line.startswith("ingest"))
    assert "cached" in ingest_line
    key = ingest_line.split()[2]
    assert main(["lineage", key]) == 0
    lineage = capsys.readouterr().out
    assert lineage.startswith(f"ingest {key}") and "source:web" in lineage
    # an override that changes ingest makes the old artifact unreachable from the newest run only;
    # gc keeps what any recorded run reached
    assert main(["run", "p.yaml", "--no-prefect", "--until", "ingest", "ingest.normalization=NFKC"]) == 0
    capsys.readouterr()
    assert main(["gc"]) == 0
    assert "0 artifacts" in capsys.readouterr().out


def test_bad_config_exit_2(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "p.yaml", "--no-prefect", "ingest.min_chars=-3"]) == 2
    err = capsys.readouterr().err
    assert "p.yaml: ingest.min_chars:" in err


def test_failed_stage_exit_1_names_it(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (project / "p.yaml").write_text("sources:\n  - name: web\n    path: nowhere\n")
    assert main(["run", "p.yaml", "--no-prefect", "--until", "ingest"]) == 2
    assert "sources.web.path" in capsys.readouterr().err


def test_flows_store_plain_parameters_as_they_are_and_encode_the_rest_like_prefect() -> None:
    """Our flows skip FastAPI's encoder (and its import) only where it would return the same thing."""
    import enum
    from datetime import date

    from fastapi.encoders import jsonable_encoder

    from flows.common import PlainParamsFlow
    from flows.lifecycle import lifecycle

    assert isinstance(lifecycle, PlainParamsFlow)
    plain = {"config": "configs/tiny.yaml", "overrides": ["train.lr=3e-4", "sources=[{name: a}]"],
             "from_stage": None, "until": "dedup", "n": 3, "x": 0.5, "ok": True, "d": {"k": [1, "v"]}}
    got = lifecycle.serialize_parameters(plain)
    assert got == jsonable_encoder(plain)
    assert got["overrides"] is not plain["overrides"]  # a copy, as the encoder gives

    class Mode(enum.IntEnum):
        FAST = 1

    other = {"when": date(2026, 11, 30), "mode": Mode.FAST, "pair": ("a", "b"), "nan": float("nan")}
    expected = {k: jsonable_encoder(v) for k, v in other.items()}
    got = lifecycle.serialize_parameters(other)  # not plain JSON: Prefect's own path
    assert {k: v for k, v in got.items() if k != "nan"} == {k: v for k, v in expected.items() if k != "nan"}
    assert got["when"] == "2026-11-30" and got["mode"] == 1 and got["pair"] == ["a", "b"]
