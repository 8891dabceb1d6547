"""README's config reference is generated from the models: it must not drift from the code."""

import subprocess
import sys

from tests.conftest import ROOT


def test_readme_config_reference_is_current() -> None:
    ref = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py")], capture_output=True,
                         text=True, check=True).stdout
    readme = (ROOT / "README.md").read_text()
    missing = [line for line in ref.splitlines() if line not in readme]
    assert not missing, ("README.md's config reference is stale; regenerate it with "
                         "`python scripts/config_reference.py`:\n" + "\n".join(missing[:10]))


def test_ci_runs_the_readmes_two_commands_in_order() -> None:
    """The Quick start's two commands are exactly what CI runs, main job first; `make run` installs no test tools."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make run", "make test"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert [c for c in ci if c.startswith("make")] == commands
    make = (ROOT / "Makefile").read_text()
    run_deps = make.split("\nrun:", 1)[1].splitlines()[0].split()
    assert run_deps == ["install"]
    install = make.split("\ninstall:", 1)[1].split("\n\n", 1)[0]
    assert "[test]" not in install and "--test" not in install
