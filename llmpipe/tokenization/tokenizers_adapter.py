"""The one place llmpipe steers the ``tokenizers`` library's own thread pool.

``tokenizers`` parallelizes ``encode_batch`` on a Rayon pool unless ``TOKENIZERS_PARALLELISM`` is
false, and that variable is its only switch: the Python API has no per-call or per-tokenizer
setting. The tokenize stage's local executor encodes several pieces at once on threads sharing one
tokenizer; each ``encode_batch`` should then stay on its calling thread, because on top of those
threads the library's pool only adds hand-offs. Measured on 2 cores: two threads sharing a
tokenizer encoded the benchmark's texts in 0.81-0.95x the time of one library-parallel
``encode_batch``; two forked processes took 1.2-1.4x.

The library reads the variable on every call (``tests/unit/tokenization/test_tokenizers_adapter.py``
pins that), so setting it around the encode phase is enough; it is restored afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

VARIABLE = "TOKENIZERS_PARALLELISM"


@contextmanager
def encode_on_calling_thread(on: bool) -> Iterator[None]:
    """Inside the block (when ``on``), ``encode_batch`` runs on the thread that calls it."""
    before = os.environ.get(VARIABLE)
    if on:
        os.environ[VARIABLE] = "false"
    try:
        yield
    finally:
        if on:
            if before is None:
                os.environ.pop(VARIABLE, None)
            else:
                os.environ[VARIABLE] = before
