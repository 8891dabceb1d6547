"""The spine under Prefect: reruns are Cached, changes re-run exactly what they must, crashes leave nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_jsonl

pytestmark = pytest.mark.slow


def _corpus(d: Path, n: int = 40) -> Path:
    texts = [f"Document number {i} talks about rivers, bridges and the people who cross them every day. "
             f"It has enough words to pass the quality filters, and it ends with a full stop. " * 3
             for i in range(n)]
    return write_jsonl(d / "corpus" / "part-0.jsonl", [{"text": t} for t in texts])


def _overrides(tmp: Path, *extra: str) -> list[str]:
    return [f"store={tmp / 'store'}", f"state_dir={tmp / 'state'}", "executor.workers=1",
            f"sources=[{{name: web, path: {tmp / 'corpus'}}}]", *extra]


def _run(tmp: Path, *extra: str) -> dict[str, dict]:
    from flows.data_refresh import data_refresh

    rows = data_refresh(config=str(ROOT / "configs" / "tiny.yaml"), overrides=_overrides(tmp, *extra),
                        until="quality")
    return {r["stage"]: r for r in rows}


def test_rerun_is_cached_and_changes_rerun_downstream_only(prefect_api: str, tmp_path: Path) -> None:
    _corpus(tmp_path)
    first = _run(tmp_path)
    assert list(first) == ["ingest", "langid", "quality"]
    assert all(r["status"] == "ran" for r in first.values())

    again = _run(tmp_path)
    assert {s: r["state"] for s, r in again.items()} == {s: "Cached" for s in again}

    workers = _run(tmp_path, "executor.workers=2")  # how, not what: nothing re-runs
    assert all(r["state"] == "Cached" for r in workers.values())

    changed = _run(tmp_path, "langid.min_chars=25")
    assert changed["ingest"]["state"] == "Cached"
    assert changed["langid"]["status"] == "ran" and changed["quality"]["status"] == "ran"
    assert changed["langid"]["key"] != first["langid"]["key"]


def test_edited_artifact_file_is_recomputed(prefect_api: str, tmp_path: Path, caplog) -> None:
    _corpus(tmp_path)
    first = _run(tmp_path)
    langid_dir = next((tmp_path / "store" / "langid").glob(first["langid"]["key"] + "*"))
    shard = sorted((langid_dir / "shards").glob("*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    again = _run(tmp_path)
    assert again["ingest"]["state"] == "Cached"
    assert again["langid"]["status"] == "ran" and again["langid"]["key"] == first["langid"]["key"]
    assert shard.name in caplog.text
    mf = json.loads((langid_dir / "manifest.json").read_text())
    from llmpipe.store import sha256_file

    assert sha256_file(shard) == mf["files"][f"shards/{shard.name}"]["sha256"]


def test_sigkill_mid_stage_leaves_no_half_artifact(tmp_path: Path) -> None:
    big = [{"text": f"line {i} " + "words and more words " * 30} for i in range(120_000)]
    write_jsonl(tmp_path / "corpus" / "big.jsonl", big)
    cmd = [sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--no-prefect",
           "--until", "ingest", *_overrides(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ingest_root = tmp_path / "store" / "ingest"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ingest_root.is_dir() and any(p.name.startswith(".tmp-") for p in ingest_root.rglob(".tmp-*")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "ingest finished before it could be killed; make the corpus bigger"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    published = [p for p in ingest_root.iterdir() if not p.name.startswith((".", "_"))]
    assert not published, f"a killed run published {published}"
    # a shard result is renamed into place only when complete: finished ones may stay (a rerun reuses
    # them), half ones live under ".tmp-" names that nothing trusts
    shard_root = ingest_root / "_shards"
    kept = [d for d in shard_root.iterdir() if not d.name.startswith(".")] if shard_root.is_dir() else []
    assert all((d / "_DONE.json").is_file() for d in kept), kept
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from llmpipe.store import ArtifactStore

    (art,) = [p for p in ingest_root.iterdir() if not p.name.startswith((".", "_"))]
    assert ArtifactStore(tmp_path / "store").get("ingest", art.name) is not None
    assert json.loads((art / "manifest.json").read_text())["stats"]["ingested"] == 120_000


def test_cli_exit_codes(tmp_path: Path) -> None:
    bad = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml"),
                          "--no-prefect", "dedup.threshold=1.5"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "dedup.threshold" in bad.stderr
    unknown = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml"),
                              "--no-prefect", "--until", "nosuchstage"], cwd=ROOT, capture_output=True, text=True)
    assert unknown.returncode == 2 and "nosuchstage" in unknown.stderr


def test_rerun_links_the_reused_stages_reports_instead_of_republishing(prefect_api: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    def latest(keys: list[str]) -> dict[str, object]:
        with get_client(sync_client=True) as client:
            found = client.read_latest_artifacts(
                artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=keys)), limit=50)
        return {c.key: c for c in found}

    from llmpipe.store import ArtifactStore
    from tasks.stages import report_keys

    _corpus(tmp_path)
    first = _run(tmp_path)
    store = ArtifactStore(tmp_path / "store")
    arts = [store.get(s, next((tmp_path / "store" / s).glob(r["key"] + "*")).name) for s, r in first.items()]
    keys = report_keys([a for a in arts if a is not None])
    assert keys, "the curation stages publish reports (language and rejection tables)"
    published = latest(keys)
    assert set(published) == set(keys)

    again = _run(tmp_path)
    assert all(r["state"] == "Cached" for r in again.values())
    now = latest([*keys, "data-refresh-reused", "data-refresh-stages"])
    assert {k: now[k].latest_id for k in keys} == {k: published[k].latest_id for k in keys}  # not re-created
    note = now["data-refresh-reused"].data
    assert all(f"| {s} |" in note for s in again) and all(k in note for k in keys)
    table = now["data-refresh-stages"].data
    assert [row["stage"] for row in (json.loads(table) if isinstance(table, str) else table)] == list(again)
