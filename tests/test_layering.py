"""``llmpipe/`` is the library: it never imports prefect, tasks or flows."""

import ast
import subprocess
import sys

from tests.conftest import ROOT

LIB = ROOT / "llmpipe"
FORBIDDEN = ("prefect", "prefect_dask", "tasks", "flows")


def test_library_source_never_imports_prefect() -> None:
    offenders = []
    for f in sorted(LIB.rglob("*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{f.relative_to(LIB.parent)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in FORBIDDEN]
    assert not offenders, "llmpipe/ must not import Prefect layers:\n" + "\n".join(offenders)


def test_importing_the_library_loads_no_prefect() -> None:
    code = ("import sys, llmpipe.dag, llmpipe.pipeline as p; p.load_stages(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('prefect', 'tasks', 'flows')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=LIB.parent)
    assert r.returncode == 0, r.stdout + r.stderr
