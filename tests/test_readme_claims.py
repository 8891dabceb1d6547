"""The READMEs' and the documentation site's checkable sentences, checked against the code: commands and
their options, the files and names they point at, the benchmark scripts, config keys and snippets, the DAG
and flow tables, the deployments file, the example error and the automation file; and the fenced blocks
too: a sample run's stage lines against the registry, shell commands against the CLI's parser and the
configs they name, Python snippets' imports, YAML config snippets; every relative link and its anchor.
A page that names something the code does not have (or no longer has) fails here, with the thing in the
message.

Everything here is fast: nothing runs a stage, a server or a benchmark. Each check is a function of the
folder it reads (``root``), so the tests below can plant a stale page in a temporary copy and see it fail.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from llmpipe.config import ConfigError, load_config
from tests.conftest import ROOT, write_jsonl

READMES = ("README.md", "deployments/README.md", "deployments/triton/README.md")
DOCS = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")))
PAGES = (*READMES, *DOCS)  # every markdown page a user reads
REPO_DIRS = ("llmpipe", "flows", "tasks", "tests", "configs", "scripts", "benchmarks", "deployments", ".ci", "docs")
GENERATED = ("tests/e2e/_outputs/",)  # git-ignored folders the tests create
SECTIONS = ("executor", "ingest", "langid", "quality", "coherence", "expertise", "safety", "entities", "dedup", "diversity",
            "timeliness", "augment", "tokenizer", "tokenize",
            "train", "evaluate", "quantize", "deploy")
FILE_SUFFIXES = ("py", "sh", "yaml", "yml", "json", "jsonl", "md", "conf", "txt", "log", "png", "parquet", "bin", "npy")


def _text(rel: str, root: Path = ROOT) -> str:
    return (root / rel).read_text(encoding="utf-8")


def _prose(rel: str, root: Path = ROOT) -> str:
    """The markdown without its fenced blocks (those have checks of their own, below)."""
    return re.sub(r"```.*?```", "", _text(rel, root), flags=re.S)


def _spans(rel: str, root: Path = ROOT) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(rel, root))


def _fences(rel: str, root: Path = ROOT) -> list[tuple[str, str]]:
    """The fenced blocks of a page: (language, body)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", _text(rel, root), flags=re.S | re.M)


def _table(text: str, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose header's first cell is ``first_header`` (cells stripped)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = _cells(line)
        if cells and cells[0] == first_header and i + 1 < len(lines) and set(lines[i + 1]) <= set("|- :"):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            return rows
    raise AssertionError(f"no table with first header {first_header!r}")


def _cells(line: str) -> list[str]:
    if not line.startswith("|"):
        return []
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# -- the `llmpipe` command ------------------------------------------------------------------------------
def _cli_help(*argv: str) -> str:
    from flows.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return out.getvalue()


def _commands() -> set[str]:
    return set(re.search(r"\{([a-z,-]+)\}", _cli_help()).group(1).split(","))


def _unknown_options(cmd: str, options: list[str]) -> list[str]:
    usage = _cli_help(cmd)
    return [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", usage)]


def _options(span: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", span)


def test_command_table_names_every_command_and_only_real_options() -> None:
    named: dict[str, list[str]] = {}
    for cells in _table(_text("README.md"), "command"):
        for span in _ticked(cells[0]):
            words = span.split()
            cmd = words[1] if words[0] == "llmpipe" else words[0]
            named.setdefault(cmd, []).extend(_options(span))
    commands = _commands()
    assert set(named) == commands, f"README command table {sorted(named)} vs `llmpipe --help` {sorted(commands)}"
    for cmd, options in named.items():
        missing = _unknown_options(cmd, options)
        assert not missing, f"README: `llmpipe {cmd}` options {missing} are not in `llmpipe {cmd} --help`"


def command_span_problems(rel: str, root: Path = ROOT) -> list[str]:
    """Every ``llmpipe CMD ...`` a page's prose names: a real command, with options its --help lists."""
    bad = []
    commands = _commands()
    for span in _spans(rel, root):
        words = span.split()
        if len(words) < 2 or words[0] != "llmpipe" or words[1].startswith("-"):
            continue
        if words[1] not in commands:
            bad.append(f"`{span}`: no command {words[1]!r}")
        elif missing := _unknown_options(words[1], _options(span)):
            bad.append(f"`{span}`: {missing} not in `llmpipe {words[1]} --help`")
    return bad


@pytest.mark.parametrize("page", PAGES)
def test_every_llmpipe_command_a_page_names_exists(page: str) -> None:
    bad = command_span_problems(page)
    assert not bad, f"{page} names llmpipe commands that do not exist:\n" + "\n".join(bad)


def test_the_example_config_error_is_the_real_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bad-config example (a fenced block of one `FILE.yaml: key: reason` line) is what load_config says."""
    examples = [body.strip() for page in PAGES for _, body in _fences(page)
                if re.fullmatch(r"\S+\.yaml: [\w.]+: .+ got \S+", body.strip())]
    assert examples, "the example of a bad-config message is gone from the docs"
    monkeypatch.chdir(tmp_path)
    for example in examples:
        path, key = example.split(": ")[:2]
        value = re.search(r"got (\S+)$", example).group(1)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(_nested(key, yaml.safe_load(value))))
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert example in str(e.value).splitlines()


def _nested(dotted: str, value: object) -> dict:
    out: dict = {}
    node = out
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return out


# -- fenced blocks: sample runs, shell commands, Python and YAML snippets ------------------------------------
_PROGRESS = re.compile(r"^\[\s*(\d+)/(\d+)\]\s+(\S+)", re.M)
_TABLE_ROW = re.compile(r"^(\w+)\s+[0-9a-f]{12}\s+(?:ran|cached)\b", re.M)


def default_stages() -> list[str]:
    """The stages a config runs unless it turns an optional one on (``sft``, ``preference``): what a
    sample run of configs/tiny.yaml shows, the DAG line and "N stages" count."""
    from llmpipe.config import load_config
    from llmpipe.dag import active_stages

    return list(active_stages(load_config()))


def stage_count_problems(rel: str, root: Path = ROOT) -> list[str]:
    """A sample run in a fenced block shows every registered stage, numbered ``[i/N]`` in DAG order, and its
    stage table names registered stages only; "N stages" in the prose is the registry's count."""
    order = default_stages()
    bad = []
    for _, body in _fences(rel, root):
        lines = _PROGRESS.findall(body)
        if lines:
            shown = [(int(i), int(n), name) for i, n, name in lines]
            want = [(i + 1, len(order), name) for i, name in enumerate(order)]
            if shown != want:
                bad.append(f"sample run {[f'[{i}/{n}] {s}' for i, n, s in shown]} vs `llmpipe stages`: "
                           f"{len(order)} stages {order}")
        bad += [f"stage table row {name!r}: no such stage" for name in _TABLE_ROW.findall(body) if name not in order]
    for m in re.finditer(r"\b(\d+) stages\b", _prose(rel, root)):
        if int(m.group(1)) != len(order):
            bad.append(f"{m.group(0)!r}: the registry has {len(order)} stages")
    return bad


@pytest.mark.parametrize("page", PAGES)
def test_sample_runs_and_stage_counts_are_the_registry(page: str) -> None:
    bad = stage_count_problems(page)
    assert not bad, f"{page}: " + "\n".join(bad)


def test_readme_and_getting_started_show_a_whole_run() -> None:
    """What a run prints: the README and the getting-started page each show one, every stage in it."""
    for page in ("README.md", "docs/getting-started.md"):
        assert any(_PROGRESS.search(body) for _, body in _fences(page)), f"{page}: no sample run"


def _shell_commands(body: str) -> Iterator[list[str]]:
    """The commands of a shell block: comments dropped, continuation lines joined, split at ``&&``/``;``/``|``."""
    text = re.sub(r"\\\n\s*", " ", body)
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|;|\|(?!\|)", line):
            with contextlib.suppress(ValueError):
                words = shlex.split(part)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value cmd
                    words = words[1:]
                if words:
                    yield words


_CONFIG_COMMANDS = {"run": 0, "status": 0, "lr-find": 0, "export": 1}  # the command's config argument


def shell_problems(rel: str, root: Path = ROOT) -> list[str]:
    """Each ``llmpipe`` line of a shell block parses with the CLI's own parser, and the config it names
    loads with its overrides; ``make`` targets are the Makefile's; scripts a block runs exist."""
    from flows.cli import build_parser

    bad = []
    targets = set(re.findall(r"^([\w-]+):", _text("Makefile"), re.M))
    for lang, body in _fences(rel, root):
        if lang not in ("bash", "sh", "console"):
            continue
        for words in _shell_commands(body):
            cmd = " ".join(words)
            if words[0].endswith("llmpipe"):
                err = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err):
                        args = build_parser().parse_args(words[1:])
                except SystemExit:
                    bad.append(f"`{cmd}`: {err.getvalue().strip().splitlines()[-1:]}")
                    continue
                pos = _CONFIG_COMMANDS.get(words[1])
                config = getattr(args, "config", None)
                if pos is not None or config:
                    try:
                        load_config(ROOT / config, list(getattr(args, "overrides", [])))
                    except (ConfigError, OSError) as e:
                        bad.append(f"`{cmd}`: {e}")
            elif words[0] == "make" and not set(words[1:]) <= targets:
                bad.append(f"`{cmd}`: no such Makefile target")
            for w in words[1:]:
                if re.fullmatch(r"(benchmarks|scripts|configs|deployments)/[\w./-]+\.(py|sh|yaml|yml|json)", w) \
                        and not (ROOT / w).exists():
                    bad.append(f"`{cmd}`: {w} does not exist")
    return bad


@pytest.mark.parametrize("page", PAGES)
def test_shell_blocks_are_commands_the_code_takes(page: str) -> None:
    bad = shell_problems(page)
    assert not bad, f"{page} shows commands that fail:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_import_what_exists(page: str) -> None:
    bad = []
    for lang, body in _fences(page):
        if lang != "python":
            continue
        tree = ast.parse(body)  # a syntax error fails here, naming the page
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("llmpipe", "flows",
                                                                                                  "tasks"):
                file = _module_file(node.module)
                if file is None:
                    bad.append(f"no module {node.module}")
                    continue
                names = _top_level_names(file) | {p.stem for p in file.parent.glob("*.py")}
                bad += [f"{node.module} has no {a.name}" for a in node.names if a.name not in names]
    assert not bad, f"{page}: Python blocks import what does not exist: {bad}"


def _module_file(dotted: str) -> Path | None:
    mod = ROOT.joinpath(*dotted.split("."))
    for file in (mod.with_suffix(".py"), mod / "__init__.py"):
        if file.exists():
            return file
    return None


@pytest.mark.parametrize("page", PAGES)
def test_yaml_config_blocks_validate(page: str) -> None:
    """A YAML block whose keys are config sections is a config: load_config accepts it."""
    from llmpipe.config import PipelineConfig

    bad = []
    for lang, body in _fences(page):
        if lang not in ("yaml", "yml"):
            continue
        data = yaml.safe_load(body)
        if isinstance(data, dict) and set(data) <= set(PipelineConfig.model_fields):
            try:
                load_config(None, data=data)
            except ConfigError as e:
                bad.append(str(e))
    assert not bad, f"{page}: config blocks that do not validate:\n" + "\n".join(bad)


# -- links ----------------------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading (what MkDocs and the docs' links use)."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\s-]", "", text)
    return re.sub(r"[-\s]+", "-", text).strip("-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, re.M):
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}_{n}")
    return out


def link_problems(rel: str, root: Path = ROOT) -> list[str]:
    """Every relative link of a page leads to a file that exists, and its ``#anchor`` to a heading there."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(rel, root)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (root / rel).parent / file if file else root / rel
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(root) if dest.is_relative_to(root) else dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {file or rel}")
    return bad


@pytest.mark.parametrize("page", PAGES)
def test_every_link_resolves(page: str) -> None:
    bad = link_problems(page)
    assert not bad, f"{page} has broken links:\n" + "\n".join(bad)


# -- the checks fail on planted mistakes -------------------------------------------------------------------
def _copy_pages(tmp: Path) -> Path:
    for rel in PAGES:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp / rel)
    return tmp


def test_a_stale_stage_count_in_a_fenced_block_fails(tmp_path: Path) -> None:
    n = len(default_stages())
    root = _copy_pages(tmp_path)
    for page in ("README.md", "docs/getting-started.md"):
        assert not stage_count_problems(page, root)
        text = _text(page, root)
        assert f"/{n}]" in text, f"{page}: its sample run is gone"
        (root / page).write_text(text.replace(f"[ 1/{n}]", f"[ 1/{n - 1}]"), encoding="utf-8")  # one line stale
        assert any(f"[1/{n - 1}] ingest" in p for p in stage_count_problems(page, root)), page


def test_a_dropped_stage_in_a_sample_run_fails(tmp_path: Path) -> None:
    root = _copy_pages(tmp_path)
    text = _text("README.md", root)
    stale = re.sub(r"^\[\s*\d+/\d+\] dedup .*\n", "", text, flags=re.M)
    assert stale != text
    (root / "README.md").write_text(stale, encoding="utf-8")
    assert stage_count_problems("README.md", root)


def test_a_broken_docs_link_fails(tmp_path: Path) -> None:
    root = _copy_pages(tmp_path)
    assert not link_problems("docs/index.md", root)
    page = root / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the gone page](no-such-page.md) and [a gone heading](serving.md#nope).\n")
    bad = link_problems("docs/index.md", root)
    assert any("no-such-page.md" in b for b in bad) and any("#nope" in b for b in bad), bad


def test_a_bad_command_in_a_shell_block_fails(tmp_path: Path) -> None:
    root = _copy_pages(tmp_path)
    page = root / "docs" / "getting-started.md"
    page.write_text(page.read_text() + "\n```bash\nllmpipe run configs/tiny.yaml --untill dedup\n"
                    "llmpipe run configs/tiny.yaml train.no_such_key=1\n```\n")
    bad = shell_problems("docs/getting-started.md", root)
    assert len(bad) == 2 and "--untill" in bad[0] and "no_such_key" in bad[1], bad


# -- files, modules and names the pages point at ------------------------------------------------------
def _named_paths(rel: str) -> Iterator[str]:
    here = Path(rel).parent
    for span in _spans(rel):
        for tok in span.split():
            tok = tok.strip("(),;")
            if tok.split("/")[0] in REPO_DIRS and "/" in tok:
                yield re.sub(r"\b[A-Z]{2,}\b", "*", tok)  # benchmarks/NAME.py: a placeholder is any name
            elif here.parts[:1] == ("deployments",) and re.fullmatch(r"[\w.-]+\.(yml|yaml|conf)", tok):
                yield (here / tok).as_posix()  # deployments/*.md name their neighbours bare


@pytest.mark.parametrize("page", PAGES)
def test_every_file_a_page_names_exists(page: str) -> None:
    missing = []
    for tok in _named_paths(page):
        if tok.startswith(GENERATED):
            continue
        path, _, func = tok.partition(":")  # flows/lifecycle.py:lifecycle (a deployment entrypoint)
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found:
            missing.append(tok)
        elif func and func not in _top_level_names(found[0]):
            missing.append(f"{tok} (no {func} in {path})")
    assert not missing, f"{page} names what the repository does not have: {missing}"
def _top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("readme", PAGES)
def test_every_python_name_a_readme_names_is_defined(readme: str) -> None:
    """``flows.prefect_ops.trigger(...)``, ``llmpipe.serving.client.TextClient``: the module file defines the name."""
    missing = []
    for span in _spans(readme):
        m = re.match(r"((?:llmpipe|flows|tasks)(?:\.\w+)+)", span)
        if not m:
            continue
        parts = m.group(1).split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module file
            mod = ROOT.joinpath(*parts[:cut])
            file = mod.with_suffix(".py") if mod.with_suffix(".py").exists() else mod / "__init__.py"
            if file.exists():
                submodules = {p.stem for p in file.parent.glob("*.py")} | {p.name for p in file.parent.iterdir()
                                                                           if (p / "__init__.py").exists()} \
                    if file.name == "__init__.py" else set()
                if parts[cut] not in _top_level_names(file) | submodules:
                    missing.append(m.group(1))
                break
        else:
            missing.append(m.group(1))
    assert not missing, f"{readme} names Python objects that do not exist: {missing}"


# -- benchmarks -------------------------------------------------------------------------------------------
def test_benchmark_table_lists_every_script_and_each_prints_its_result_line() -> None:
    """docs/benchmarks.md: one row per script in benchmarks/, and the row's metric is the one that script's
    RESULT line prints, so each quoted figure names the script and metric that produce it."""
    rows = {_ticked(cells[0])[0]: cells for cells in _table(_text("docs/benchmarks.md"), "script")}
    bench = ROOT / "benchmarks"
    present = {p.relative_to(bench).as_posix() for p in bench.rglob("*") if p.suffix in (".py", ".sh")
               and not p.name.startswith("_") and "__pycache__" not in p.parts}
    assert set(rows) == present, f"docs/benchmarks.md table {sorted(rows)} vs benchmarks/ {sorted(present)}"
    printed = re.compile(r"RESULT \w+ \{[^}]+\} goal (>=|<=|<|>) |\bresult\(\"\w+\", .+, \"(>=|<=|<|>)\", ")
    for name in sorted(present):
        src = (bench / name).read_text(encoding="utf-8")
        assert printed.search(src), f"benchmarks/{name} prints no `RESULT <metric> <value> goal <op> <target>`"
        metric = _ticked(rows[name][1])[0]
        assert re.search(rf"RESULT {metric} |result\(\"{metric}\"", src), \
            f"docs/benchmarks.md: benchmarks/{name} prints no RESULT {metric}"
        assert re.search(r"\d{4}-\d{2}-\d{2}|—", rows[name][4]), f"docs/benchmarks.md: {name}: no date measured"
        if name.endswith(".py"):
            assert "ArgumentParser(" in src, f"benchmarks/{name} has no --help (the docs: run any with --help)"


_SPEED_FIGURE = re.compile(r"\d(?:\.\d+)?×|\d[\d,.]* ?(?:docs|tokens|requests|signatures)/s\b|\d ?µs\b")


@pytest.mark.parametrize("page", [p for p in PAGES if p != "docs/benchmarks.md"])
def test_speed_figures_are_quoted_only_beside_their_script(page: str) -> None:
    """A measured speed-up or throughput ("11.6×", "343 docs/s", "14 µs") appears only in docs/benchmarks.md,
    in the row of the script that produces it: a figure quoted elsewhere has no script to re-measure it."""
    found = _SPEED_FIGURE.findall(_text(page))
    assert not found, f"{page} quotes figures outside docs/benchmarks.md: {found} (move them to its table)"


def test_every_benchmark_answers_help() -> None:
    """README: "Run any of them with ``--help``". Also catches a benchmark a rename broke (its imports)."""
    failed = []
    for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):
        r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0 or "usage:" not in r.stdout:
            failed.append(f"{script.name}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    assert not failed, "benchmarks whose --help fails:\n" + "\n".join(failed)


# -- config keys and snippets -------------------------------------------------------------------------
def _reference_keys() -> set[str]:
    """Every key of docs/config-reference.md (generated from the config models; one table per section)."""
    return set(re.findall(r"^\| `([^`]+)` \|", _text("docs/config-reference.md"), re.M))


@pytest.mark.parametrize("readme", PAGES)
def test_every_config_key_a_readme_names_exists(readme: str) -> None:
    keys = _reference_keys()
    named = set()
    for span in _spans(readme):
        for m in re.finditer(rf"(?<![\w/.])((?:{'|'.join(SECTIONS)})(?:\.[a-z_0-9]+)+)", span):
            if m.group(1).rsplit(".", 1)[1] not in FILE_SUFFIXES:
                named.add(m.group(1))
    unknown = sorted(k for k in named if k not in keys and not any(r.startswith(k + ".") for r in keys))
    assert named or readme not in ("README.md", "docs/config-reference.md", "docs/troubleshooting.md")
    assert not unknown, f"{readme} names config keys the config models do not have: {unknown}"


def _snippets(readme: str) -> Iterator[tuple[str, dict]]:
    """``executor: {kind: dask, ...}`` and ``train.launch.launcher: deepspeed`` spans, as config data."""
    for span in _spans(readme):
        m = re.fullmatch(rf"((?:{'|'.join(SECTIONS)}|store)(?:\.[a-z_]+)*): (.+)", span)
        if m:
            value = yaml.safe_load(m.group(2).replace(": R,", ": 1,"))  # node_rank: R, a placeholder
            yield span, _nested(m.group(1), value)


CONTEXT = {  # a word of a snippet -> (the span that must sit beside it in the README, the config it adds)
    "train.launch.launcher": ("train.strategy: deepspeed", {"train": {"strategy": "deepspeed"}}),
    "train.launch.hostfile": ("train.strategy: deepspeed",
                              {"train": {"strategy": "deepspeed", "launch": {"launcher": "deepspeed"}}}),
    "deploy.backend: vllm": ("deploy.target: gpu", {"deploy": {"target": "gpu"}}),
}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("readme", PAGES)
def test_every_config_snippet_a_readme_shows_is_valid(readme: str) -> None:
    snippets = list(_snippets(readme))
    spans = {span for span, _ in snippets}
    bad = []
    for span, data in snippets:
        # a snippet that needs another setting is read with it, where the README's sentence names it
        for needs, context in CONTEXT.items():
            if needs in span and context[0] in spans:
                data = _merge(context[1], data)
        try:
            load_config(None, data=data)
        except ConfigError as e:
            bad.append(f"`{span}`: {e}")
    assert not bad, f"{readme} shows config that does not validate:\n" + "\n".join(bad)
    if readme == "docs/scaling.md":
        assert len(snippets) >= 5


def test_readme_overrides_are_valid() -> None:
    readme = _text("README.md")
    for override in ("train.optimizer.lr=3e-4", "langid.thresholds={en: 0.7}", "executor.workers=4"):
        assert f"`{override}`" in readme
        load_config(None, [override])


def test_training_topology_is_a_run_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README: 2 nodes × 1 process has the same key as 1 node × 2 processes."""
    from llmpipe.dag import plan

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", [{"text": "one small document"}])
    base = {"sources": [{"name": "d", "path": str(tmp_path / "d.jsonl")}]}
    one = plan(load_config(None, ["train.launch.nodes=1", "train.launch.nproc_per_node=2"], data=base))
    two = plan(load_config(None, ["train.launch.nodes=2", "train.launch.nproc_per_node=1",
                                  "train.launch.node_rank=1", "train.launch.rdzv_endpoint=host0:29400"], data=base))
    assert {k: v.key for k, v in one.items()} == {k: v.key for k, v in two.items()}


def test_source_hash_cache_trusts_size_and_mtime_else_hashes(tmp_path: Path) -> None:
    """README: raw sources are keyed by content, size + mtime fast path, sha256 otherwise."""
    from llmpipe.sources import HashCache
    from llmpipe.store import sha256_file

    f = tmp_path / "a.txt"
    f.write_text("alpha")
    cache = HashCache(tmp_path / "cache.json")
    first = cache.sha256(f)
    assert first == sha256_file(f)
    st = f.stat()
    f.write_text("omega")  # same size; put the old mtime back: the fast path answers from the cache
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.sha256(f) == first
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime: hashed again
    assert cache.sha256(f) == sha256_file(f) != first


# -- the DAG and the flows ----------------------------------------------------------------------------
def test_the_dag_line_and_the_stage_table_are_the_registered_stages_in_order() -> None:
    from llmpipe.pipeline import load_stages

    order = default_stages()  # the optional stages are in the stage table, not on the DAG line
    for page in ("README.md", "docs/index.md"):
        line = next(x for x in _text(page).splitlines() if x.startswith("ingest → "))
        assert line.split(" → ") == order, f"{page}'s DAG line vs `llmpipe stages`: {order}"
    assert [_ticked(cells[0])[0] for cells in _table(_text("docs/stages/index.md"), "stage")] == list(load_stages())


def test_every_stage_has_a_section_on_its_family_page() -> None:
    """docs/stages/index.md links each stage to a heading named after it on its family's page."""
    from llmpipe.pipeline import load_stages

    rows = {_ticked(cells[0])[0]: cells[1] for cells in _table(_text("docs/stages/index.md"), "stage")}
    for stage in load_stages():
        target = re.search(r"\]\(([^)#]+)#([\w-]+)\)", rows[stage])
        assert target, f"docs/stages/index.md: {stage} links to no section"
        page = ROOT / "docs" / "stages" / target.group(1)
        assert target.group(2) in _anchors(page), f"{page.name} has no section #{target.group(2)} for {stage}"
        if target.group(2) == stage:
            assert f"## `{stage}`" in page.read_text(encoding="utf-8")


@pytest.mark.parametrize("page", ["README.md", "docs/concepts.md"])
def test_flow_table_matches_the_stages_each_flow_runs(page: str) -> None:
    from flows.cli import FLOW_NAMES
    from flows.prefect_ops import DEPLOY_DEFAULTS
    from llmpipe.pipeline import load_stages

    stages = load_stages()
    rows = {_ticked(cells[0])[0]: cells for cells in _table(_text(page), "flow")}
    assert set(rows) == set(FLOW_NAMES)
    for flow, cells in rows.items():
        if flow == "lifecycle":
            assert cells[1] == "all of them"
            continue
        mine = [s for s, spec in stages.items() if spec.flow == flow]
        first, last = re.match(r"(\w+) → (\w+)", cells[1]).groups()
        assert (first, last) == (mine[0], mine[-1]), f"{page} flow {flow}: {cells[1]} vs {mine}"
    assert f"`{DEPLOY_DEFAULTS['LLMPIPE_NIGHTLY_CRON']}`" in rows["data_refresh"][2]


# -- deployments/README.md against deployments/prefect.yaml and flows/prefect_ops.py ----------------------------
def test_deployments_table_is_prefect_yaml() -> None:
    from flows.prefect_ops import DEPLOY_DEFAULTS, WORK_POOL

    doc = _text("deployments/README.md")
    spec = yaml.safe_load(_text("deployments/prefect.yaml"))
    flow_names = {"flows/data_refresh.py:data_refresh": "data-refresh"}
    declared = {}
    for d in spec["deployments"]:
        flow = flow_names.get(d["entrypoint"], d["entrypoint"].rsplit(":", 1)[1])
        declared[f"{flow}/{d['name']}"] = d
    rows = {_ticked(cells[0])[0]: cells for cells in _table(doc, "deployment")}
    assert set(rows) == set(declared), (sorted(rows), sorted(declared))
    for name, cells in rows.items():
        d = declared[name]
        assert _ticked(cells[1])[0] == d["entrypoint"]
        assert "llmpipe" in d["tags"] and d["concurrency_limit"] == 1  # README: alerts by tag; one run at once
        assert d["work_pool"]["name"] == "{{ $LLMPIPE_WORK_POOL }}"
        assert d["parameters"] == {"config": "{{ $LLMPIPE_CONFIG }}", "overrides": []}
        assert bool(d.get("schedules")) == (cells[2] != "—"), name
    assert f"`{WORK_POOL}` work pool" in doc
    env = {_ticked(cells[0])[0]: _ticked(cells[1])[0] for cells in _table(doc, "variable")}
    assert env == DEPLOY_DEFAULTS


def test_flow_parameters_have_defaults_and_stages_retry_on_io_errors_only() -> None:
    """README: every flow parameter has a default (Quick run); retries happen on I/O errors only."""
    from prefect.states import Failed

    from flows.cli import flow_function
    from tasks.stages import run_stage

    for name in ("lifecycle", "data_refresh", "pretrain", "release"):
        params = inspect.signature(flow_function(name).fn).parameters.values()
        assert all(p.default is not inspect.Parameter.empty for p in params), name
    assert run_stage.retries > 0
    retry = run_stage.retry_condition_fn
    assert retry(run_stage, None, Failed(data=ConnectionResetError("reset by peer")))
    assert retry(run_stage, None, Failed(data=TimeoutError("slow object store")))
    assert not retry(run_stage, None, Failed(data=ValueError("bad data")))
    assert not retry(run_stage, None, Failed(data=FileNotFoundError("gone")))


def test_the_automation_file_in_the_deployments_readme_validates() -> None:
    """The YAML for ``prefect automation create --from-file`` is what that command's model accepts."""
    from prefect.events.schemas.automations import AutomationCore

    block = re.search(r"automation create --from-file.*?```yaml\n(.+?)```", _text("deployments/README.md"), re.S)
    assert block, "deployments/README.md: the automation file is gone"
    data = yaml.safe_load(block.group(1).replace("<webhook block id>", str(uuid.uuid4())))
    automation = AutomationCore.model_validate(data)
    assert set(automation.trigger.expect) == {"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}


# -- the troubleshooting page: every row names something llmpipe has ---------------------------------------
_SOURCES = ("llmpipe", "flows", "tasks", "deployments")


def _source_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for d in _SOURCES
                     for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".yml", ".yaml"))


def troubleshooting_problems(root: Path = ROOT) -> list[str]:
    """Each row's "what llmpipe shows" cell names at least one guard, metric, command or file, and each of
    them exists: a config key of the reference, an ``llmpipe`` command with real options, a file of the
    repository, or a name (a metric, a stats field, a report) the code writes."""
    keys, commands, source = _reference_keys(), _commands(), _source_text()
    bad = []
    text = _text("docs/troubleshooting.md", root)
    rows = [row for header in ("symptom",) for row in _all_tables(text, header)]
    if len(rows) < 8:
        bad.append(f"only {len(rows)} troubleshooting rows")
    for cells in rows:
        names = _ticked(cells[2])
        if not names:
            bad.append(f"{cells[0]!r}: names nothing llmpipe shows")
        for name in names:
            if name.startswith("llmpipe "):
                words = name.split()
                ok = words[1] in commands and not _unknown_options(words[1], _options(name))
            elif re.fullmatch(rf"(?:{'|'.join(SECTIONS)})(?:\.\w+)+(?:: .+)?", name):
                key = name.split(":")[0]
                ok = key in keys or any(k.startswith(key + ".") for k in keys)
            elif "/" in name:
                ok = (ROOT / name).exists() or re.sub(r"^<\w+>/|/$", "", name).split("/")[-1] in source
            else:
                ok = re.sub(r"\(.*\)$", "", name) in source
            if not ok:
                bad.append(f"{cells[0]!r}: `{name}` is not in llmpipe")
    return bad


def _all_tables(text: str, first_header: str) -> list[list[str]]:
    """The rows of every table whose header's first cell is ``first_header``."""
    rows: list[list[str]] = []
    for chunk in re.split(r"\n(?=\| " + re.escape(first_header) + r" \|)", text)[1:]:
        rows += _table(chunk, first_header)
    return rows


def test_troubleshooting_rows_name_what_exists() -> None:
    bad = troubleshooting_problems()
    assert not bad, "docs/troubleshooting.md:\n" + "\n".join(bad)


def test_troubleshooting_covers_the_seeds_symptoms() -> None:
    """The seeds' table: loss NaN, low GPU utilisation, oscillating validation metric, a speed drop when
    mixed precision stops working; and their memory-leak checklist."""
    symptoms = " ".join(cells[0] for cells in _all_tables(_text("docs/troubleshooting.md"), "symptom"))
    for words in ("NaN", "GPU utilisation", "validation metric oscillates", "throughput suddenly drops",
                  "memory grows", "out of memory"):
        assert words in symptoms, f"docs/troubleshooting.md has no row for {words!r}"


def test_a_troubleshooting_row_naming_a_missing_guard_fails(tmp_path: Path) -> None:
    root = _copy_pages(tmp_path)
    page = root / "docs" / "troubleshooting.md"
    page.write_text(page.read_text().replace("`train.guards.spike_factor`", "`train.guards.spike_limit`", 1))
    assert any("spike_limit" in b for b in troubleshooting_problems(root))


# -- where the model is, and how to talk to it -----------------------------------------------------------
_LAYOUTS = {"pretrain": "llmpipe.training.layout:PRETRAIN", "evaluate": "llmpipe.evaluation.layout:EVALUATE",
            "quantize": "llmpipe.quantization.layout:QUANTIZE", "deploy": "llmpipe.serving.layout:DEPLOY"}


def _layout_names(stage: str) -> set[str]:
    import dataclasses
    import importlib

    if stage not in _LAYOUTS:
        return set()
    module, name = _LAYOUTS[stage].split(":")
    layout = getattr(importlib.import_module(module), name)
    return {getattr(layout, f.name) for f in dataclasses.fields(layout)}


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_where_the_model_is_and_how_to_reach_it(page: str) -> None:
    """The artifact paths are the tiny config's store, a registered stage and a file its layout declares;
    the served model's name and ports are the deploy defaults and `llmpipe serve`'s."""
    from flows.cli import build_parser
    from llmpipe.pipeline import load_stages
    from llmpipe.serving.config import DeployConfig

    text = _text(page)
    store = load_config(ROOT / "configs" / "tiny.yaml").store
    paths = re.findall(r"`(\.llmpipe/store/(\w+)/<key>/([\w.-]*))/?`", text)
    assert paths and store == ".llmpipe/store", f"{page}: no artifact paths, or the tiny store moved ({store})"
    for path, stage, first in paths:
        assert stage in load_stages(), f"{page}: {path}: no stage {stage}"
        assert not first or first in _layout_names(stage), f"{page}: {path}: {stage}'s layout has no {first}"
    args = build_parser().parse_args(["serve"])
    assert f"HTTP {args.http_port}, gRPC {args.grpc_port}, metrics {args.metrics_port}" in text, page
    assert f'"{DeployConfig().model_name}")' in text, f"{page}: the client's model is not deploy.model_name's default"
