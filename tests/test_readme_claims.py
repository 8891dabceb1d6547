"""The READMEs' checkable sentences, checked against the code: commands and their options, the files and
names they point at, the benchmark scripts, config keys and snippets, the DAG and flow tables, the
deployments file, the example error and the automation file. A README that names something the code
does not have (or no longer has) fails here, with the sentence's thing in the message.

Everything here is fast: nothing runs a stage, a server or a benchmark.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import os
import re
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
REPO_DIRS = ("llmpipe", "flows", "tasks", "tests", "configs", "scripts", "benchmarks", "deployments", ".ci")
GENERATED = ("tests/e2e/_outputs/",)  # git-ignored folders the tests create
SECTIONS = ("executor", "ingest", "langid", "quality", "coherence", "expertise", "safety", "entities", "dedup", "diversity",
            "timeliness", "augment", "tokenizer", "tokenize",
            "train", "evaluate", "quantize", "deploy")
FILE_SUFFIXES = ("py", "sh", "yaml", "yml", "json", "md", "conf", "txt", "log", "png", "parquet")


def _text(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def _prose(rel: str) -> str:
    """The markdown without its fenced blocks (example output and shell sessions are not claims of names)."""
    return re.sub(r"```.*?```", "", _text(rel), flags=re.S)


def _spans(rel: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(rel))


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


def test_command_table_names_every_command_and_only_real_options() -> None:
    named: dict[str, list[str]] = {}
    for cells in _table(_text("README.md"), "command"):
        for span in _ticked(cells[0]):
            words = span.split()
            cmd = words[1] if words[0] == "llmpipe" else words[0]
            named.setdefault(cmd, []).extend(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", span))
    commands = set(re.search(r"\{([a-z,-]+)\}", _cli_help()).group(1).split(","))
    assert set(named) == commands, f"README command table {sorted(named)} vs `llmpipe --help` {sorted(commands)}"
    for cmd, options in named.items():
        usage = _cli_help(cmd)
        missing = [o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", usage)]
        assert not missing, f"README: `llmpipe {cmd}` options {missing} are not in `llmpipe {cmd} --help`"


def test_the_example_config_error_is_the_real_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = re.search(r"A bad config fails before any work.*?```\n(.+?)\n```", _text("README.md"), re.S)
    assert block, "README: the example of a bad-config message is gone"
    example = block.group(1).strip()
    path, key = example.split(": ")[:2]
    value = re.search(r"got (\S+)$", example).group(1)
    monkeypatch.chdir(tmp_path)
    Path(path).parent.mkdir(parents=True)
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


# -- files, modules and names the READMEs point at ------------------------------------------------------
def _named_paths(rel: str) -> Iterator[str]:
    here = Path(rel).parent
    for span in _spans(rel):
        for tok in span.split():
            tok = tok.strip("(),;")
            if tok.split("/")[0] in REPO_DIRS and "/" in tok:
                yield re.sub(r"\b[A-Z]{2,}\b", "*", tok)  # benchmarks/NAME.py: a placeholder is any name
            elif here != Path(".") and re.fullmatch(r"[\w.-]+\.(yml|yaml|conf)", tok):
                yield (here / tok).as_posix()  # deployments/*.md name their neighbours bare


@pytest.mark.parametrize("readme", READMES)
def test_every_file_a_readme_names_exists(readme: str) -> None:
    missing = []
    for tok in _named_paths(readme):
        if tok.startswith(GENERATED):
            continue
        path, _, func = tok.partition(":")  # flows/lifecycle.py:lifecycle (a deployment entrypoint)
        found = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not found:
            missing.append(tok)
        elif func and func not in _top_level_names(found[0]):
            missing.append(f"{tok} (no {func} in {path})")
    assert not missing, f"{readme} names what the repository does not have: {missing}"


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


@pytest.mark.parametrize("readme", READMES)
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
                if parts[cut] not in _top_level_names(file):
                    missing.append(m.group(1))
                break
        else:
            missing.append(m.group(1))
    assert not missing, f"{readme} names Python objects that do not exist: {missing}"


# -- benchmarks -------------------------------------------------------------------------------------------
def test_benchmark_table_lists_every_script_and_each_prints_a_result_line() -> None:
    listed = {_ticked(cells[0])[0] for cells in _table(_text("README.md"), "script")}
    bench = ROOT / "benchmarks"
    present = {p.relative_to(bench).as_posix() for p in bench.rglob("*") if p.suffix in (".py", ".sh")
               and not p.name.startswith("_") and "__pycache__" not in p.parts}
    assert listed == present, f"README benchmark table {sorted(listed)} vs benchmarks/ {sorted(present)}"
    printed = re.compile(r"RESULT \w+ \{[^}]+\} goal (>=|<=|<|>) |\bresult\(\"\w+\", .+, \"(>=|<=|<|>)\", ")
    for name in sorted(present):
        src = (bench / name).read_text(encoding="utf-8")
        assert printed.search(src), f"benchmarks/{name} prints no `RESULT <metric> <value> goal <op> <target>`"
        if name.endswith(".py"):
            assert "ArgumentParser(" in src, f"benchmarks/{name} has no --help (README: run any with --help)"


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
    return {_ticked(cells[0])[0] for cells in _table(_text("README.md"), "key")}


@pytest.mark.parametrize("readme", READMES)
def test_every_config_key_a_readme_names_exists(readme: str) -> None:
    keys = _reference_keys()
    named = set()
    for span in _spans(readme):
        for m in re.finditer(rf"(?<![\w/.])((?:{'|'.join(SECTIONS)})(?:\.[a-z_0-9]+)+)", span):
            if m.group(1).rsplit(".", 1)[1] not in FILE_SUFFIXES:
                named.add(m.group(1))
    unknown = sorted(k for k in named if k not in keys and not any(r.startswith(k + ".") for r in keys))
    assert named and not unknown, f"{readme} names config keys the config models do not have: {unknown}"


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


@pytest.mark.parametrize("readme", READMES)
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
    if readme == "README.md":
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

    order = list(load_stages())
    readme = _text("README.md")
    line = next(x for x in readme.splitlines() if x.startswith("ingest → "))
    assert line.split(" → ") == order, f"README's DAG line vs `llmpipe stages`: {order}"
    assert [_ticked(cells[0])[0] for cells in _table(readme, "stage")] == order


def test_flow_table_matches_the_stages_each_flow_runs() -> None:
    from flows.cli import FLOW_NAMES
    from flows.prefect_ops import DEPLOY_DEFAULTS
    from llmpipe.pipeline import load_stages

    stages = load_stages()
    rows = {_ticked(cells[0])[0]: cells for cells in _table(_text("README.md"), "flow")}
    assert set(rows) == set(FLOW_NAMES)
    for flow, cells in rows.items():
        if flow == "lifecycle":
            assert cells[1] == "all of them"
            continue
        mine = [s for s, spec in stages.items() if spec.flow == flow]
        first, last = re.match(r"(\w+) → (\w+)", cells[1]).groups()
        assert (first, last) == (mine[0], mine[-1]), f"README flow {flow}: {cells[1]} vs {mine}"
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
