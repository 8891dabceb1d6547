"""benchmarks/eval_harness.py --quick on the session's toy model: it runs, both paths agree, it reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_eval_harness_benchmark_quick_run(toy_lm) -> None:  # noqa: ANN001
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "eval_harness.py"), "--quick",
                        "--model", str(toy_lm.pretrain), "--tasks", "tiny_mc"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})  # nothing downloaded
    assert r.returncode == 0, r.stderr[-2000:]  # exits non-zero when ours and the harness's numbers differ
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("48 items of tiny_mc,")
    m = re.fullmatch(r"RESULT eval_harness (\d+\.\d{3}) goal >= 0.9", lines[-1])
    assert m and float(m.group(1)) > 0  # the ratio itself is a timing on a shared machine: not asserted
