"""File placement shared by the stages and the store."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def link_file(src: Path, dst: Path) -> None:
    """Place ``src`` at ``dst`` without copying bytes when the filesystem allows (hard link)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
