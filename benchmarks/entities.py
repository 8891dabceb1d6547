"""Entity recognition throughput: the rule recognizer, and our batched NER against the transformers
``pipeline("token-classification")`` called document by document on the same model and documents.

The model is the tiny BERT token classifier of ``tests/fixtures/tiny_ner.py``, trained here offline
in a few seconds (no hub). Ours tokenizes every document once with offsets, batches windows across
documents by length and decodes spans from offsets; the baseline is the loop a user would write:
``ner(text)`` per document with ``aggregation_strategy="first"``. Both sides find the same names
(checked). Times are process CPU seconds, on one torch thread, so other jobs on a shared machine do
not distort the ratio.

    .venv/bin/python benchmarks/entities.py [--docs 400]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# benchmarks/ holds scripts named like stdlib modules (tokenize.py): never import from it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from benchmarks._common import result  # noqa: E402
from llmpipe.curation.entities.config import NerSettings, RuleSettings  # noqa: E402
from llmpipe.curation.entities.ner import TokenClassifier  # noqa: E402
from llmpipe.curation.entities.rules import RuleRecognizer  # noqa: E402
from tests.fixtures.tiny_ner import FIRST, LAST, TRAIN_TEMPLATES, make_tiny_ner  # noqa: E402

RULE_TEXT = ("On March 5, 2024 at 14:30 the council paid $5 million (12%) for 3.5 km of road; see "
             "https://example.com/a. 2024年3月5日下午3点，公司花了500万元。")


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Documents of 1-12 template sentences with planted names (the model's vocabulary)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sents = []
        for _ in range(rng.randint(1, 12)):
            t = rng.choice(TRAIN_TEMPLATES)
            name = rng.choice(FIRST) + " " + rng.choice(LAST)
            sents.append(t.replace("{n}", name).replace("{m}", rng.choice(FIRST)))
        out.append(" ".join(sents))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    args = ap.parse_args()
    if args.quick:
        args.docs = 40
    import torch
    from transformers import pipeline

    torch.set_num_threads(1)
    docs = make_docs(args.docs)
    rules = RuleRecognizer(RuleSettings())
    texts = [RULE_TEXT + " " + d for d in docs]
    t0 = time.process_time()
    n_rule = sum(len(s) for s in rules.recognize(texts))
    rule_s = time.process_time() - t0
    print(f"rules: {len(texts) / rule_s:.0f} docs/s ({n_rule} spans)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_ner(Path(tmp) / "ner")
        ours = TokenClassifier(NerSettings(max_length=128, stride=16, batch_size=32), str(model_dir))
        ours.recognize(docs[:8])  # warm up both sides
        t0 = time.process_time()
        mine = ours.recognize(docs)
        ours_s = time.process_time() - t0
        ner = pipeline("token-classification", model=str(model_dir), aggregation_strategy="first", device="cpu",
                       stride=16)
        ner.tokenizer.model_max_length = 128
        ner(docs[0])
        t0 = time.process_time()
        theirs = [ner(d) for d in docs]
        base_s = time.process_time() - t0
    same = sum(len(a) for a in mine), sum(len(b) for b in theirs)
    agree = sum(sum(1 for s in a if any(b["start"] == s["start"] and b["end"] == s["end"] for b in bs))
                for a, bs in zip(mine, theirs, strict=True))
    print(f"ner ours: {len(docs) / ours_s:.1f} docs/s ({same[0]} spans); pipeline loop: {len(docs) / base_s:.1f} "
          f"docs/s ({same[1]} spans); {agree} spans at the same offsets")
    result("ner_speedup_vs_pipeline_loop", base_s / ours_s, ">=", 1.0)


if __name__ == "__main__":
    main()
