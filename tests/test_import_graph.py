"""The package import graph has no cycle: not at module level, and not through imports inside functions.

A cycle that a lazy import hides still ties two modules together (neither can be read, tested or
moved without the other), so both kinds of import count. Read from the source with ``ast``: nothing
is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("llmpipe", "tasks", "flows")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names]
            graph[mod] |= {t for t in targets if t and t != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycle_in_the_packages() -> None:
    cycles = _cycles(_graph(_modules()))
    assert not cycles, f"modules that import each other (directly or in a ring): {cycles}"


def test_the_cycle_finder_finds_a_planted_ring() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _string_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Modules named in string constants: the stage registry's import list, ``python -m`` commands."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in mods:
                edges[mod].add(node.value)
    return edges


def test_every_library_module_is_used_by_the_product() -> None:
    """Nothing in llmpipe/ exists only for tests or benchmarks: fixtures live in tests/fixtures/.

    Reached from the console script (``flows.cli``), the flows the deployments name, and the stage
    registry, following imports and module names in strings (``importlib``, ``python -m``).
    """
    mods = _modules()
    graph, strings = _graph(mods), _string_edges(mods)
    seen: set[str] = set()
    todo = ["flows.cli", *(m for m in mods if m.startswith("flows."))]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in mods]
        todo += sorted(graph[m] | strings[m])
    unused = sorted(m for m in mods if m not in seen and not m.endswith("__main__"))
    assert not unused, f"library modules the product never imports (move test helpers to tests/fixtures/): {unused}"


def test_tests_import_helpers_only_from_tests() -> None:
    """A test imports the product (llmpipe, tasks, flows), libraries, or helpers under tests/, never
    benchmarks/ or scripts/ (a helper two places need lives in tests/fixtures/)."""
    offenders = []
    for f in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            offenders += [f"{f.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in ("benchmarks", "scripts")]
    assert not offenders, "tests import helpers from outside tests/:\n" + "\n".join(offenders)
