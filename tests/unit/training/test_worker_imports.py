"""What a launched process imports: each training rank and each Triton model instance pays its imports
again at every start, so the libraries only the parent needs must stay out of them.

Measured on the shared 2-core box (``python -X importtime``): a tiny training rank spends ~7 CPU s
importing, nearly all of it torch and transformers' Llama code (scikit-learn, pulled in by
``transformers.generation`` because lm_eval installs it; ``torch._dynamo`` from its masking code);
our own modules add ~0.2 s (pydantic for ``TrainConfig``). These tests keep it that way: a module
that grows a top-level ``import prefect`` (or the pipeline config, or a curation stage) would add
seconds to every rank of every launch, in the suite and for users.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import import_probe_trainer as probe

REPO = Path(__file__).resolve().parents[3]

# never in a training rank: orchestration, data-set tooling, plotting, evaluation and serving
# libraries, and our modules that import them (the pipeline config imports every stage's section)
FORBIDDEN = ("prefect", "datasets", "matplotlib", "lm_eval", "fastapi", "uvicorn", "flows", "tasks",
             "llmpipe.config", "llmpipe.pipeline", "llmpipe.curation", "llmpipe.evaluation",
             "llmpipe.serving", "llmpipe.quantization", "llmpipe.posttrain", "llmpipe.executor")
# what a rank may load of ours: the training package and the layouts it reads
ALLOWED_OURS = ("llmpipe", "llmpipe.config_base", "llmpipe.tokenization", "llmpipe.tokenization.layout",
                "llmpipe.tokenization.tokenizer", "llmpipe.training")


def _hits(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def _modules_after(code: str) -> list[str]:
    """``sys.modules`` of a fresh interpreter after ``code``: what a process start imports."""
    probe_code = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe_code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_training_modules_import_nothing_a_rank_does_not_need() -> None:
    """The modules a rank imports (entry, then setup's lazy imports) load no transformers yet, and
    nothing of FORBIDDEN: transformers is imported by the model build, once."""
    mods = _modules_after("import llmpipe.training.trainer, llmpipe.training.model, llmpipe.training.data, "
                          "llmpipe.training.engines, llmpipe.training.resume, llmpipe.training.watch")
    assert not _hits(mods, FORBIDDEN + ("transformers", "sklearn", "pandas"))
    ours = [m for m in mods if m == "llmpipe" or m.startswith("llmpipe.")]
    assert all(m in ALLOWED_OURS or m.startswith("llmpipe.training.") for m in ours), ours


def test_triton_model_file_imports_torch_only() -> None:
    """The deploy stage copies triton_model.py to ``model.py``; Triton's Python stub imports it for each
    model instance. At import it loads torch and the standard library only (transformers comes with
    ``initialize``), and never llmpipe: the same file runs in NVIDIA's Triton image."""
    path = REPO / "llmpipe" / "serving" / "triton_model.py"
    mods = _modules_after("import importlib.util, sys\n"
                          f"spec = importlib.util.spec_from_file_location('model', {str(path)!r})\n"
                          "sys.modules['model'] = mod = importlib.util.module_from_spec(spec)\n"
                          "spec.loader.exec_module(mod)")
    assert not _hits(mods, FORBIDDEN + ("transformers", "pydantic", "llmpipe", "sklearn"))
    assert "torch" in mods


@pytest.mark.slow
def test_a_real_rank_imports_nothing_a_rank_does_not_need(tmp_path: Path, packed: Path, tiny_train,
                                                         worker_spec) -> None:
    """One real rank under torchrun, through setup, training, checkpoint and export: its ``sys.modules``
    at the end holds none of FORBIDDEN and of ours only the training modules and the layouts."""
    from llmpipe.training.config import TrainConfig
    from llmpipe.training.launch import launch

    train = TrainConfig.model_validate(tiny_train(max_steps=2, launch={"nproc_per_node": 1}))
    run = tmp_path / "run"
    launch(train.launch, worker_spec(train, packed, run), run, env={"PYTHONPATH": str(REPO)},
           module=probe.MODULE)
    mods = json.loads(probe.modules_file(run, 0).read_text())
    assert "transformers" in mods and "torch" in mods  # the probe saw a real worker's modules
    assert not _hits(mods, FORBIDDEN)
    ours = [m for m in mods if m == "llmpipe" or m.startswith("llmpipe.")]
    assert all(m in ALLOWED_OURS or m.startswith("llmpipe.training.") for m in ours), ours
