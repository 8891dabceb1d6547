"""Learning the DAG is cheap: registering every stage imports none of the heavy libraries.

Every ``llmpipe`` command (a no-change rerun above all) imports all stage modules to learn names,
inputs and versions; torch, numba, datasketch or pyarrow there would cost seconds per command.
"""

import subprocess
import sys

from tests.conftest import ROOT

HEAVY = ("torch", "transformers", "datasketch", "numba", "tritonclient", "deepspeed", "pyarrow", "numpy",
         "scipy", "datasets", "tokenizers", "matplotlib", "llmcompressor")


def test_registering_the_stages_imports_no_heavy_library() -> None:
    code = ("import sys, llmpipe.dag, llmpipe.pipeline as p; n = len(p.load_stages()); "
            f"bad = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})); "
            "print(n, bad); sys.exit(1 if bad or n < 12 else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_lazy_module_imports_on_first_use_and_mirrors_the_module() -> None:
    code = ("import sys; from llmpipe.lazy import lazy_import; j = lazy_import('wave'); "
            "assert 'wave' not in sys.modules; f = j.open; assert 'wave' in sys.modules; "
            "import wave; assert f is wave.open and j.Error is wave.Error and j.__name__ == 'wave'; "
            "assert 'open' in vars(j); assert lazy_import('wave') is wave")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
