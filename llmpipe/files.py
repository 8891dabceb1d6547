"""File placement shared by the stages and the store."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def link_file(src: Path, dst: Path) -> None:
    """Place ``src`` at ``dst`` without copying bytes when the filesystem allows (hard link)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def jsonl_values(path: Path) -> Iterator[tuple[str, Any]]:
    """``("file:line", value)`` for each non-empty line of a JSONL file; a line that is not JSON raises
    naming the file and the line (what the value must hold is the caller's to check)."""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
