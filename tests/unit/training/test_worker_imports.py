"""What a launched process imports at its start: each training rank and each Triton model instance pays
its imports again, so the libraries only the parent needs must stay out of them.

Measured on the shared 2-core box: a tiny training rank spends ~7 CPU s importing, nearly all of it
torch and transformers' Llama code (scikit-learn, pulled in by ``transformers.generation`` because
lm_eval installs it; ``torch._dynamo`` from its masking code); our own modules add ~0.2 s (pydantic
for ``TrainConfig``). These tests keep it that way: a module that grows a top-level ``import prefect``
(or of the pipeline config, or of a curation stage) would add seconds to every rank of every launch.
What a real rank holds at the end of a run, export included, is checked by the launches of
``test_training_skips.py`` (every engine; ``tests/fixtures/rank_imports.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures.rank_imports import FORBIDDEN, matching, unneeded

REPO = Path(__file__).resolve().parents[3]


def _modules_after(code: str) -> list[str]:
    """``sys.modules`` of a fresh interpreter after ``code``: what a process start imports."""
    probe_code = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe_code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_training_modules_import_nothing_a_rank_does_not_need() -> None:
    """The modules a rank imports (its entry, then setup's imports) load nothing of FORBIDDEN and, of
    ours, only the training package and the layouts it reads."""
    mods = _modules_after("import llmpipe.training.trainer, llmpipe.training.model, llmpipe.training.data, "
                          "llmpipe.training.engines, llmpipe.training.resume, llmpipe.training.watch")
    assert "llmpipe.training.engines" in mods and not unneeded(mods), unneeded(mods)


def test_triton_model_file_imports_torch_only() -> None:
    """The deploy stage copies triton_model.py to ``model.py``; Triton's Python stub imports it for each
    model instance. At import it loads torch and the standard library only (transformers comes with
    ``initialize``), and never llmpipe: the same file runs in NVIDIA's Triton image."""
    path = REPO / "llmpipe" / "serving" / "triton_model.py"
    mods = _modules_after("import importlib.util, sys\n"
                          f"spec = importlib.util.spec_from_file_location('model', {str(path)!r})\n"
                          "sys.modules['model'] = mod = importlib.util.module_from_spec(spec)\n"
                          "spec.loader.exec_module(mod)")
    assert not matching(mods, FORBIDDEN + ("transformers", "pydantic", "llmpipe", "sklearn"))
    assert "torch" in mods
