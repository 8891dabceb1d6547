"""The default corpus of ``configs/tiny.yaml``: real text that every install has, offline.

* Python's own documentation: ``pydoc_data.topics`` ships with CPython (≈80 topics, ≈460 kB of
  English technical prose), cut into paragraph-aligned documents.
* The prose of the standard library's docstrings (:data:`STDLIB_MODULES`, a fixed list of pure-Python
  modules, ≈480 kB): enough English for the tiny model to learn more than word frequencies in a
  CPU-minute. The topics alone are too little: they are code-heavy, and the quality filters keep
  only about a third of their bytes.
* A small multilingual sample the project wrote itself (:mod:`llmpipe.data.multilingual`).
* Planted work for the later stages: exact and near-duplicates of known edits, boilerplate and junk
  that the quality filters must reject, personal data that the safety stage must redact.

It is generated deterministically, so its content key never changes between runs or machines with
the same CPython release (a bugfix release may edit a docstring or a topic): the docstrings are read
from the standard library's source files with :mod:`ast` (nothing is imported, so no module's side
effects and no installed third-party package can change them), in the fixed module order and in
source order within a module.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from llmpipe.data.multilingual import SAMPLES

CHUNK_CHARS = 1800


def pydoc_documents() -> list[dict[str, str]]:
    import pydoc_data.topics as topics

    docs = []
    for name in sorted(topics.topics):
        text = topics.topics[name].strip()
        paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        docs += _chunks(f"pydoc-{name}", paras, {"topic": name})
    return docs


# Pure-Python standard library modules with much English prose in their docstrings, present in every
# CPython 3.10+ on every platform (none of the modules PEP 594 removed); a missing one is skipped.
STDLIB_MODULES = (
    "argparse", "ast", "asyncio/base_events", "asyncio/events", "asyncio/locks", "asyncio/streams",
    "asyncio/tasks", "bdb", "calendar", "codecs", "collections/__init__", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "difflib", "doctest", "email/header", "email/headerregistry",
    "email/message", "enum", "fileinput", "fractions", "ftplib", "functools", "gettext", "gzip", "heapq",
    "http/client", "http/cookiejar", "http/server", "imaplib", "inspect", "ipaddress", "json/__init__",
    "logging/__init__", "logging/handlers", "lzma", "mailbox", "mimetypes", "os", "pathlib", "pdb", "pickle",
    "pkgutil", "platform", "pydoc", "queue", "random", "shutil", "smtplib", "socket", "socketserver", "ssl",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "traceback", "typing", "unittest/case", "unittest/mock", "urllib/parse", "urllib/request", "uuid",
    "warnings", "weakref", "xml/etree/ElementTree", "xml/sax/handler", "xmlrpc/server", "zipfile",
)
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_WORD = re.compile(r"[A-Za-z][a-z]*(?:'[a-z]+)?")


def _docstrings(node: ast.AST) -> Iterator[str]:
    """Docstrings of a module and of its classes and functions at any depth, in source order."""
    if isinstance(node, (ast.Module, *_DEFS)) and (doc := ast.get_docstring(node, clean=True)):
        yield doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (*_DEFS, ast.If, ast.Try)):  # definitions under ``if``/``try`` count too
            yield from _docstrings(child)


def _prose(doc: str) -> Iterator[str]:
    """The paragraphs of a docstring that read as sentences, each joined onto one line.

    Code (doctests, indented blocks, argument tables) and fragments are left out: the point is text
    a person would write, which is also what the quality filters keep.
    """
    for para in re.split(r"\n\s*\n", doc):
        lines = para.split("\n")
        if any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        words = text.split()
        if len(words) < 6 or not text.endswith((".", "!", "?")):
            continue
        if sum(bool(_WORD.fullmatch(w.strip(".,;:!?()'\""))) for w in words) < 0.7 * len(words):
            continue
        yield text


def _chunks(prefix: str, paras: list[str], extra: dict[str, str]) -> list[dict[str, str]]:
    """Paragraph-aligned documents of about ``CHUNK_CHARS`` characters."""
    docs: list[dict[str, str]] = []
    chunk: list[str] = []
    for p in paras:
        chunk.append(p)
        if sum(len(c) for c in chunk) >= CHUNK_CHARS:
            docs.append({"id": f"{prefix}-{len(docs)}", "text": "\n\n".join(chunk), **extra})
            chunk = []
    if chunk:
        docs.append({"id": f"{prefix}-{len(docs)}", "text": "\n\n".join(chunk), **extra})
    return docs


def stdlib_documents(modules: tuple[str, ...] = STDLIB_MODULES) -> list[dict[str, str]]:
    """The docstring prose of ``modules`` (paths under the standard library, without ``.py``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[dict[str, str]] = []
    seen: set[str] = set()  # overriding methods repeat their base's docstring verbatim: keep the first
    for name in modules:
        path = root / f"{name}.py"
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        paras = []
        for para in (p for doc in _docstrings(tree) for p in _prose(doc)):
            if para not in seen:
                seen.add(para)
                paras.append(para)
        module = name.removesuffix("/__init__").replace("/", ".")
        docs += _chunks(f"stdlib-{module}", paras, {"module": module})
    if not docs:
        raise FileNotFoundError(f"builtin:tiny reads the standard library's .py sources, and {root} has none of "
                                f"{len(modules)} modules (an install without sources?)")
    return docs


def multilingual_documents() -> list[dict[str, str]]:
    docs = []
    for lang, paras in sorted(SAMPLES.items()):
        sep = "" if lang in ("zh", "ja") else " "
        for i in range(len(paras)):
            text = paras[i] + sep + paras[(i + 1) % len(paras)]
            docs.append({"id": f"{lang}-{i}", "text": text, "lang_hint": lang})
        docs.append({"id": f"{lang}-all", "text": "\n\n".join(paras), "lang_hint": lang})
    return docs


def _edit_words(text: str, rng: random.Random, n_edits: int) -> str:
    words = text.split(" ")
    for _ in range(n_edits):
        i = rng.randrange(len(words))
        words[i] = rng.choice(["data", "value", "object", "module", "thing", "item"])
    return " ".join(words)


def planted_documents(pydoc: list[dict[str, str]]) -> list[dict[str, str]]:
    rng = random.Random(20261130)
    long_docs = [d for d in pydoc if len(d["text"]) > 1200]
    out: list[dict[str, str]] = []
    for i, d in enumerate(rng.sample(long_docs, 12)):  # near-duplicates: a few words changed
        out.append({"id": f"near-dup-{i}", "text": _edit_words(d["text"], rng, 3), "planted": "near_duplicate"})
    for i, d in enumerate(rng.sample(long_docs, 6)):  # exact copies
        out.append({"id": f"exact-dup-{i}", "text": d["text"], "planted": "exact_duplicate"})
    junk = [
        "Click here",
        "lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 8,
        "Please enable JavaScript to view this page.\nThis site uses cookies.\nPrivacy policy\nTerms of use",
        "BUY NOW!!! $$$ ### @@@ %%% &&& *** ### $$$ @@@ !!! ### $$$ ### @@@" * 5,
        ("home\n" * 40),
        "- item one\n- item two\n- item three\n- item four\n- item five\n- item six\n- item seven",
        "{ } { } { } function() { return null; } { } var x = {};",
        "...\n...\n...\n...\nmore...\nread more...\n...",
    ]
    for i, t in enumerate(junk):
        out.append({"id": f"junk-{i}", "text": t, "planted": "junk"})
    pii = [
        "For questions about the workshop, write to the organiser at maria.lopez@example.org or call "
        "+1 415 555 0134 before Friday. The registration form is on the community centre's page, and "
        "the room can hold about thirty people, so please sign up early if you would like to attend.",
        "The test server answers on 192.168.10.24 and its IPv6 address is 2001:db8::ff00:42:8329. "
        "Remember that these addresses are only for the internal documentation example and that the "
        "production machines are configured by the operations team, who keep the inventory up to date.",
        "The old receipt showed the card number 4111 1111 1111 1111 next to the amount, which is why "
        "the shop changed its printer settings. Receipts now show only the last four digits, and the "
        "manager explained the change to every customer who asked about it during the following weeks.",
    ]
    for i, t in enumerate(pii):
        out.append({"id": f"pii-{i}", "text": t, "planted": "pii"})
    return out


def build(name: str = "tiny") -> dict[str, list[dict[str, str]]]:
    if name != "tiny":
        raise ValueError(f"unknown builtin corpus {name!r}; available: tiny")
    pydoc = pydoc_documents()
    return {"pydoc.jsonl": pydoc, "stdlib.jsonl": stdlib_documents(), "multilingual.jsonl": multilingual_documents(),
            "planted.jsonl": planted_documents(pydoc)}


STAMP = ".inputs.json"


def _inputs_fingerprint(name: str) -> str:
    """What the corpus is made from: this code, the Python version, and size + mtime of every
    standard-library file it reads. Parsing those files costs about a CPU-second; a run whose
    fingerprint matches the last one's skips that (the DESIGN's size+mtime fast path for sources)."""
    import pydoc_data.topics

    import llmpipe.data.multilingual as multilingual

    h = hashlib.sha256(f"{name}\0{sys.version}".encode())
    for code in (Path(__file__), Path(multilingual.__file__)):
        h.update(code.read_bytes())
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in [Path(pydoc_data.topics.__file__), *(root / f"{m}.py" for m in STDLIB_MODULES)]:
        st = path.stat() if path.is_file() else None
        h.update(f"{path}\0{st and st.st_size}\0{st and st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _files_state(target: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(target.glob("*.jsonl"))}


def materialize(name: str, root: Path) -> Path:
    """Write the corpus as JSONL files under ``root/name`` (only when their bytes would change).

    A stamp records the inputs' fingerprint and the files written; when both still match, nothing is
    rebuilt."""
    target = Path(root) / name
    target.mkdir(parents=True, exist_ok=True)
    stamp = target / STAMP
    want = {"inputs": _inputs_fingerprint(name)}
    try:
        if json.loads(stamp.read_text()) == {**want, "files": _files_state(target)}:
            return target
    except (OSError, ValueError):
        pass
    corpus = build(name)
    for fname, docs in corpus.items():
        data = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode()
        path = target / fname
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            continue
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    for stale in set(_files_state(target)) - set(corpus):  # a file an older corpus had
        (target / stale).unlink()
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps({**want, "files": _files_state(target)}))
    os.replace(tmp, stamp)
    return target
