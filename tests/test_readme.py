"""README and the docs site against the code: the generated config reference is current, the README stays a
ten-minute read, and its two commands are what CI runs."""

import re
import subprocess
import sys

from tests.conftest import ROOT

README_MAX_BYTES = 12_000


def test_config_reference_page_is_current() -> None:
    """docs/config-reference.md is exactly what scripts/config_reference.py prints: generated, never edited."""
    ref = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py")], capture_output=True,
                         text=True, check=True).stdout
    page = (ROOT / "docs" / "config-reference.md").read_text(encoding="utf-8")
    assert page == ref, ("docs/config-reference.md is stale; regenerate it with "
                         "`python scripts/config_reference.py --write`:\n" +
                         "\n".join(sorted(set(ref.splitlines()) ^ set(page.splitlines()))[:10]))


def test_readme_is_a_ten_minute_read() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes (at most {README_MAX_BYTES:,}): move detail to docs/"


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


def test_the_install_extras_the_docs_name_are_the_makefiles() -> None:
    """`make run` installs `.[all]`, `make test` `.[all,coherence,test]`: the README and getting started
    say what the Makefile does (the extras were once stale)."""
    make = (ROOT / "Makefile").read_text()
    extras = {target: re.search(r"pip install .*-e '(\.\[[\w,]+\])'", make.split(f"\n{target}:", 1)[1].split("\n\n")[0])
              .group(1) for target in ("install", "install-test")}
    for page in ("README.md", "docs/getting-started.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        named = set(re.findall(r"\.\[all[\w,]*\]", text))  # the installs (one extra alone is an example)
        assert set(extras.values()) <= named, f"{page} does not name the Makefile's installs {sorted(extras.values())}"
        assert named <= set(extras.values()), f"{page} names installs the Makefile does not do: {sorted(named)}"
