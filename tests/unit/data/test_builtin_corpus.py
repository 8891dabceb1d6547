"""The built-in corpus' standard-library part: prose only, read from source, the same bytes every time."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from llmpipe.data import builtin_corpus
from llmpipe.data.builtin_corpus import STDLIB_MODULES, _docstrings, _prose, stdlib_documents


def test_prose_keeps_sentences_and_drops_code_and_fragments() -> None:
    doc = ("Return a new list containing all items from the iterable in ascending order.\n\n"
           ">>> sorted([3, 1, 2])\n[1, 2, 3]\n\n"
           "Arguments:\n    key -- a function of one argument\n\n"
           "Short line.\n\n"
           "The sort is stable: it\nnever changes the relative order of equal elements.")
    assert list(_prose(doc)) == [
        "Return a new list containing all items from the iterable in ascending order.",
        "The sort is stable: it never changes the relative order of equal elements.",  # re-wrapped on one line
    ]


def test_docstrings_in_source_order_at_any_depth() -> None:
    src = ('"""Module."""\nclass A:\n    """Class A."""\n    def f(self):\n        """Method f."""\n'
           'try:\n    def g():\n        """Function g."""\nexcept ImportError:\n    pass\n')
    assert list(_docstrings(ast.parse(src))) == ["Module.", "Class A.", "Method f.", "Function g."]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, str]]:
    return stdlib_documents()


def test_stdlib_documents_are_substantial_unique_and_free_of_doctests(docs: list[dict[str, str]]) -> None:
    assert len({d["id"] for d in docs}) == len(docs)
    assert sum(len(d["text"]) for d in docs) > 300_000  # the tiny run needs this much English to learn from
    assert len({d["module"] for d in docs}) > 0.9 * len(STDLIB_MODULES)
    assert not any(">>>" in d["text"] for d in docs)
    paras = [p for d in docs for p in d["text"].split("\n\n")]
    assert len(paras) == len(set(paras))


def test_same_bytes_in_a_fresh_interpreter(docs: list[dict[str, str]], tmp_path) -> None:  # noqa: ANN001
    """The docstrings are parsed from source, never imported: a new process with another hash seed
    and other modules loaded writes the same documents."""
    ours = json.dumps(docs, sort_keys=True)
    code = ("import json, sys; from llmpipe.data.builtin_corpus import stdlib_documents; "
            "sys.stdout.write(json.dumps(stdlib_documents(), sort_keys=True))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=tmp_path).stdout
    assert other == ours
    assert "stdlib.jsonl" in builtin_corpus.build("tiny")


def test_materialize_skips_the_rebuild_only_while_inputs_and_files_are_unchanged(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    target = builtin_corpus.materialize("tiny", tmp_path)
    files = {p.name: p.read_bytes() for p in target.glob("*.jsonl")}
    assert set(files) == {"pydoc.jsonl", "stdlib.jsonl", "multilingual.jsonl", "planted.jsonl"}
    real_build = builtin_corpus.build

    def no_build(name: str) -> dict:
        raise AssertionError("rebuilt although nothing changed")

    monkeypatch.setattr(builtin_corpus, "build", no_build)
    builtin_corpus.materialize("tiny", tmp_path)  # the stamp matches: no parsing

    monkeypatch.setattr(builtin_corpus, "build", real_build)
    (target / "stdlib.jsonl").write_text('{"id": "edited", "text": "x"}\n')
    (target / "old.jsonl").write_text("{}\n")  # what an older corpus left behind
    builtin_corpus.materialize("tiny", tmp_path)
    assert {p.name: p.read_bytes() for p in target.glob("*.jsonl")} == files


def test_no_standard_library_sources_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="standard library's .py sources"):
        stdlib_documents(("no_such_module_a", "no/such/module_b"))
