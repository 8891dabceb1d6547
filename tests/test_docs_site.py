"""The documentation site builds with ``mkdocs build --strict``: no broken link or anchor, no page left out
of the navigation, no missing page. Skipped, with the reason, where MkDocs is not installed (the
``[test]`` extra, which ``make test`` installs)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("material") is None,
                                reason="mkdocs-material is not installed (pip install -e '.[test]')")


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_strict(tmp_path: Path) -> None:
    r = _build(ROOT, tmp_path / "site")
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-3000:]}"
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


def test_a_broken_docs_link_fails_the_build(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy2(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    page = root / "docs" / "operations.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [the gone page](no-such-page.md).\n", encoding="utf-8")
    r = _build(root, tmp_path / "site")
    assert r.returncode != 0 and "no-such-page.md" in r.stderr, r.stderr[-3000:]
