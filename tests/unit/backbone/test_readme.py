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


def test_readme_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
