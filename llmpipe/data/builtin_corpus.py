"""The default corpus of ``configs/tiny.yaml``: real text that every install has, offline.

* Python's own documentation: ``pydoc_data.topics`` ships with CPython (≈80 topics, ≈460 kB of
  English technical prose), cut into paragraph-aligned documents.
* A small multilingual sample the project wrote itself (:mod:`llmpipe.data.multilingual`).
* Planted work for the later stages: exact and near-duplicates of known edits, boilerplate and junk
  that the quality filters must reject, personal data that the safety stage must redact.

It is generated deterministically, so its content key never changes between runs or machines.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from llmpipe.data.multilingual import SAMPLES

CHUNK_CHARS = 1800


def pydoc_documents() -> list[dict[str, str]]:
    import pydoc_data.topics as topics

    docs = []
    for name in sorted(topics.topics):
        text = topics.topics[name].strip()
        paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        chunk: list[str] = []
        part = 0
        for p in paras:
            chunk.append(p)
            if sum(len(c) for c in chunk) >= CHUNK_CHARS:
                docs.append({"id": f"pydoc-{name}-{part}", "text": "\n\n".join(chunk), "topic": name})
                chunk, part = [], part + 1
        if chunk:
            docs.append({"id": f"pydoc-{name}-{part}", "text": "\n\n".join(chunk), "topic": name})
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
    return {"pydoc.jsonl": pydoc, "multilingual.jsonl": multilingual_documents(),
            "planted.jsonl": planted_documents(pydoc)}


def materialize(name: str, root: Path) -> Path:
    """Write the corpus as JSONL files under ``root/name`` (only when their bytes would change)."""
    target = Path(root) / name
    target.mkdir(parents=True, exist_ok=True)
    for fname, docs in build(name).items():
        data = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode()
        path = target / fname
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            continue
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return target
