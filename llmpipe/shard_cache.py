"""The per-shard cache: a refresh that adds input files only computes the new shards.

A finished shard lives at ``<store>/<stage>/_shards/<shard key>/`` with a ``_DONE.json`` marker
holding its stats. It is written to a temporary sibling and renamed, so a killed run leaves nothing
that a later run trusts (:meth:`llmpipe.stage.StageContext.cached_map` drives it).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

DONE = "_DONE.json"



def run_shard_job(job: tuple[Callable[[Any, Path], dict[str, Any]], Any, str]) -> None:
    fn, arg, final = job
    final_path = Path(final)
    tmp = final_path.parent / f".tmp-{final_path.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    stats = fn(arg, tmp) or {}
    stats.setdefault("seconds", round(time.perf_counter() - t0, 4))
    (tmp / DONE).write_text(json.dumps(stats, sort_keys=True))
    try:
        os.rename(tmp, final_path)
    except OSError:  # another worker finished the same shard first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
