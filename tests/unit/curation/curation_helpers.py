"""Helpers for the curation filter tests: real sentences, documents (a uniquely named module)."""

from __future__ import annotations

import os

from llmpipe.document import Document

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GOOD_EN = (
    "The city council met on Tuesday to discuss the new budget for public libraries and parks.\n"
    "Several residents spoke in favour of longer opening hours, and the mayor agreed to review the plan.\n"
    "A final decision is expected next month, after the finance committee has examined the costs.\n"
    "Local businesses have also offered to sponsor reading programs for children during the summer.\n"
    "The library director said that demand for digital books has grown steadily over the past five years."
)


def doc(text: str, **meta: object) -> Document:
    return Document(id=str(abs(hash(text)) % 10**12), text=text, source="test", metadata=dict(meta))
