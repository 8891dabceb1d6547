"""Every benchmark runs in the suite at a small size (``--quick``) and ends with its RESULT line.

A benchmark that only answers ``--help`` can rot unseen (three once crashed on a renamed stage input
while the README quoted their figures): each script here runs for real, on its quick size, and its
last line must be ``RESULT <metric> <value> goal <op> <target>``. The quick figures are not claims
(tiny sizes, a shared machine); the run proves the script still works end to end.

A new script in ``benchmarks/`` fails ``test_every_benchmark_has_a_quick_run`` until it is listed in
``QUICK`` (and has ``--quick``). ``benchmarks/gpu/`` needs a CUDA GPU: on a machine without one the
test checks that each script refuses with one line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from llmpipe.serving.vllm_engine import vllm_python
from tests.conftest import ROOT

BENCH = ROOT / "benchmarks"
RESULT = re.compile(r"RESULT \w+ -?[\d.]+(e-?\d+)? goal (>=|<=|<|>) -?[\d.]+")
SLOW = pytest.mark.slow
NEEDS_VLLM = pytest.mark.skipif(vllm_python() is None and vllm_python(base=ROOT) is None,
                                reason="vLLM (CPU build) is not installed: scripts/install.sh --test builds .venv-vllm; "
                                "or set LLMPIPE_VLLM_PYTHON")
# script -> (timeout in seconds, marks). Slow: the quick run starts servers, worker processes or a
# whole (short) pipeline; the others take seconds.
QUICK: dict[str, tuple[int, tuple[pytest.MarkDecorator, ...]]] = {
    "async_checkpoint.py": (300, (SLOW,)),  # two 2-rank torchrun runs
    "awq.py": (600, (SLOW,)),
    "cache_overhead.py": (900, (SLOW,)),
    "coherence.py": (300, (SLOW,)),
    "curation_vs_datatrove.py": (900, (SLOW,)),  # builds datatrove's own venv on first use
    "dask_scaling.py": (600, (SLOW,)),
    "decode_step.py": (300, ()),  # the streaming engine's decode step vs the plain loop, in process
    "dedup_memory.py": (300, (SLOW,)),
    "dedup_quality.py": (300, ()),  # the must-show precision / recall and cluster cost, small
    "dedup_refresh.py": (300, (SLOW,)),
    "dpo.py": (300, (SLOW,)),  # sft and DPO (TRL) steps on a random tiny model
    "diversity.py": (300, (SLOW,)),
    "entities.py": (300, ()),
    "ingest.py": (300, ()),
    "langid.py": (300, ()),
    "lifecycle.py": (900, (SLOW,)),
    "minhash.py": (300, ()),
    "scale.py": (300, (SLOW,)),
    "serve_latency.py": (600, (SLOW,)),
    "serve_vs_vllm.py": (900, (SLOW, NEEDS_VLLM)),
    "tiny_vs_unigram.py": (900, (SLOW,)),
    "tokenize.py": (300, ()),
    "train_throughput.py": (600, (SLOW,)),
}
GPU_ONLY = ("gpu/run.sh",)
# scripts whose quick run needs a session fixture, so it lives beside that fixture's tests
USES_PREFECT_SERVER = {"cache_overhead.py"}  # their --quick runs flows on the server PREFECT_API_URL names
QUICK_ELSEWHERE = {"eval_harness.py": "tests/unit/evaluation/test_eval_harness_benchmark.py"}  # the toy model


def _scripts() -> set[str]:
    return {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*") if p.suffix in (".py", ".sh")
            and not p.name.startswith("_") and "__pycache__" not in p.parts}


def test_every_benchmark_has_a_quick_run() -> None:
    scripts = _scripts()
    for script, test in QUICK_ELSEWHERE.items():
        assert f'"{script}"' in (ROOT / test).read_text() and '"--quick"' in (ROOT / test).read_text(), test
    missing = sorted(scripts - set(QUICK) - set(GPU_ONLY) - set(QUICK_ELSEWHERE))
    assert not missing, f"benchmarks without a quick run in tests/test_benchmarks_quick.py QUICK: {missing}"
    gone = sorted((set(QUICK) | set(GPU_ONLY) | set(QUICK_ELSEWHERE)) - scripts)
    assert not gone, f"QUICK names scripts benchmarks/ no longer has: {gone}"
    no_flag = [s for s in QUICK if '"--quick"' not in (BENCH / s).read_text(encoding="utf-8")]
    assert not no_flag, f"benchmarks without a --quick option: {no_flag}"


def _last_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("script", [pytest.param(s, marks=m) for s, (_t, m) in sorted(QUICK.items())])
def test_quick_run_prints_its_result_line(script: str, request: pytest.FixtureRequest) -> None:
    timeout = QUICK[script][0]
    if script in USES_PREFECT_SERVER:  # the session's server (PREFECT_API_URL) instead of one of its own
        request.getfixturevalue("prefect_api")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, str(BENCH / script), "--quick"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    tail = (r.stdout[-2000:] + "\n--- stderr ---\n" + r.stderr[-3000:])
    assert r.returncode == 0, f"benchmarks/{script} --quick exited {r.returncode}:\n{tail}"
    last = _last_line(r.stdout)
    assert RESULT.fullmatch(last), f"benchmarks/{script} --quick: last line {last!r} is not a RESULT line:\n{tail}"


@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_benchmark_refuses_without_a_gpu_in_one_line(script: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip(f"a CUDA GPU is here: run `bash benchmarks/{script}` for the real figure")
    r = subprocess.run(["bash", str(BENCH / script)], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
                       capture_output=True, text=True, timeout=120)
    out = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode != 0 and len(out) == 1 and "GPU" in out[0], (r.returncode, out)
