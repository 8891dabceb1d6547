"""The command line: status, lineage and gc on a real (tiny) store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from llmpipe.pipeline import load_stages
from tests.conftest import write_jsonl


@pytest.fixture
def project(workdir: Path) -> Path:
    write_jsonl(workdir / "data" / "a.jsonl", [{"text": f"hello number {i}"} for i in range(5)])
    (workdir / "p.yaml").write_text("sources:\n  - name: web\n    path: data\nexecutor:\n  workers: 1\n")
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


def test_no_sources_is_a_config_error(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (workdir / "p.yaml").write_text("sources: []\n")
    assert main(["run", "p.yaml", "--no-prefect"]) == 2
    assert "sources: a pipeline needs at least one source" in capsys.readouterr().err


def _console(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real console script, without any Prefect setting of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run([str(Path(sys.executable).parent / "llmpipe"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("config", "override", "expected"), [
    ("sources: []\n", None, "sources: a pipeline needs at least one source, got []"),
    ("sources:\n  - {name: web, path: nowhere}\n", None, "sources.web.path:"),
    ("sources:\n  - {name: web, path: data}\n", "train.optimizer.lr=fast", "p.yaml: train.optimizer.lr: "),
])
def test_bad_config_refused_before_prefect_starts(tmp_path: Path, config: str, override: str | None,
                                                   expected: str) -> None:
    """Exit 2 naming the key, from the console script, and Prefect never started (no database, no home)."""
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"text": "hello there"}])
    (tmp_path / "p.yaml").write_text(config)
    run = _console(tmp_path, "run", "p.yaml", *([override] if override else []))
    assert run.returncode == 2, run.stderr
    assert expected in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / ".llmpipe" / "prefect").exists()


def test_failed_stage_prints_one_error_naming_stage_reason_and_log(tmp_path: Path) -> None:
    """A stage that fails: one message on stderr with the stage, the reason and its log file; the
    traceback is in that log, not on the terminal."""
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"text": f"hello number {i}, a short line"} for i in range(5)])
    (tmp_path / "p.yaml").write_text("sources:\n  - {name: web, path: data}\nexecutor: {workers: 1}\n"
                                     "tokenizer: {pretrained: no-such-tokenizer}\n")
    run = _console(tmp_path, "run", "p.yaml", "--no-prefect", "--until", "tokenizer")
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[0].startswith("llmpipe: stage 'tokenizer' failed:"), run.stderr
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout
    log = tmp_path / lines[-1].split("log: ", 1)[1]
    assert log.name == "tokenizer.log" and "no-such-tokenizer" in log.read_text()
    n = [*load_stages()].index("tokenizer") + 1  # the stages up to it (curation's dimensions among them)
    assert f"[ 1/{n}] ingest" in run.stdout and f"[{n - 1:>2}/{n}] augment" in run.stdout  # the stages before it


def test_verbose_run_shows_the_logs_in_the_terminal(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"text": f"hello number {i}, a short line"} for i in range(5)])
    (tmp_path / "p.yaml").write_text("sources:\n  - {name: web, path: data}\nexecutor: {workers: 1}\n")
    quiet = _console(tmp_path, "run", "p.yaml", "--no-prefect", "--until", "ingest")
    assert quiet.returncode == 0 and quiet.stderr == "" and "INFO" not in quiet.stdout, quiet.stdout
    loud = _console(tmp_path, "run", "p.yaml", "--no-prefect", "--until", "ingest", "-v", "ingest.normalization=NFKC")
    assert loud.returncode == 0 and "INFO" in loud.stderr, loud.stderr


def test_on_a_terminal_the_running_stage_line_is_replaced_by_its_result(tmp_path: Path) -> None:
    """On a tty each stage first shows `running ...`, then the same line (after a carriage return) its result."""
    import pty
    import select

    write_jsonl(tmp_path / "data" / "a.jsonl", [{"text": f"hello number {i}, a short line"} for i in range(5)])
    (tmp_path / "p.yaml").write_text("sources:\n  - {name: web, path: data}\nexecutor: {workers: 1}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    leader, follower = pty.openpty()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "llmpipe"), "run", "p.yaml", "--no-prefect",
                             "--until", "langid"], cwd=tmp_path, env=env, stdin=follower, stdout=follower,
                            stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            break
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    screen = b"".join(chunks).decode(errors="replace")
    assert "[ 1/2] ingest     running ..." in screen and "\r[ 1/2] ingest     ran" in screen, screen
    assert "Traceback" not in screen and "INFO" not in screen
