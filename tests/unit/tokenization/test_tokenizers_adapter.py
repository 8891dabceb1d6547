"""Pins what ``llmpipe.tokenization.tokenizers_adapter`` relies on in the ``tokenizers`` library.

If an upgrade stops reading ``TOKENIZERS_PARALLELISM`` on each call (or drops it), this test fails
here, with this message, instead of the tokenize stage silently running two pools on top of each other.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

PROBE = textwrap.dedent("""
    import os
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from llmpipe.tokenization.tokenizers_adapter import VARIABLE, encode_on_calling_thread

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = ["the cat sat on the mat and the dog sat on the log"] * 5000
    threads = lambda: len(os.listdir("/proc/self/task"))
    with encode_on_calling_thread(True):
        tok.train_from_iterator(texts[:50], trainers.BpeTrainer(vocab_size=60, show_progress=False))
        before = threads()
        inside = tok.encode_batch(texts)
        during = threads()
    assert VARIABLE not in os.environ, "the variable must be restored"
    outside = tok.encode_batch(texts)
    after = threads()
    assert [e.ids for e in inside] == [e.ids for e in outside]
    print(before, during, after)
""")


def test_the_variable_keeps_encode_batch_on_the_calling_thread_and_is_read_per_call() -> None:
    env = {"PATH": "/usr/bin:/bin", "RAYON_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    before, during, after = map(int, r.stdout.split())
    assert during == before, ("tokenizers started its own pool although TOKENIZERS_PARALLELISM=false: "
                              "llmpipe.tokenization.tokenizers_adapter no longer works with this version")
    assert after > during, ("tokenizers did not start its pool once the variable was gone: it no longer "
                            "reads TOKENIZERS_PARALLELISM per call; see llmpipe.tokenization.tokenizers_adapter")
