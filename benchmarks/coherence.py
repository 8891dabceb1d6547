"""Coherence stage docs/s with the KenLM scorer ÷ ``kenlm.Model.score`` in a plain loop; our own model's docs/s.

Both sides score the same documents with the same model and the same CCNet normalization and word
split (:func:`llmpipe.curation.coherence.kenlm_perplexity` is the loop's body): the ratio is what the
stage adds around the model (reading and writing shards, per-shard caching, the run-wide buckets,
the funnel). The model is a 3-gram ARPA estimated from a reference sample of the test grammar
(outside the timing), given to the stage by path; the stage's input shards are written before its
timing starts (writing them is the upstream stage's work, not this one's). Both are timed in CPU
seconds of this process (the stage runs in it with one worker), which other jobs on a shared machine
skew less than wall seconds (``--workers 2`` times wall seconds instead); the two run ``--rounds`` times,
interleaved, and the figure is the median of the rounds' ratios (stage ÷ loop of the same round): a
round's two sides run seconds apart and share the machine's state, where the two sides' best rounds
can come minutes apart (on the shared 2-core machine the same loop took 7.0 to 9.5 CPU seconds from
one round to the next, so one lucky loop round decided the ratio of bests; it is printed too). Also
printed: the stage with our own small causal LM (``scorer: model``, a tiny Llama trained for a few
seconds) on CPU. The stage has a fixed cost per run (the funnel chart, the bucket cuts: about 0.15 s)
that a corpus amortizes: the default is 60k documents, where it is about 2% of the stage.

    python benchmarks/coherence.py [--docs 20000] [--model-docs 600] [--workers 1] [--rounds 7]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from benchmarks._common import result  # noqa: E402
from llmpipe.curation.coherence import build_reference_model, kenlm_perplexity, load_kenlm  # noqa: E402
from llmpipe.curation.dimensions_config import CoherenceConfig  # noqa: E402
from llmpipe.executor import LocalExecutor  # noqa: E402
from tests.fixtures.quality_corpus import (  # noqa: E402
    documents,
    labelled_corpus,
    run_stage,
    train_tiny_lm,
    write_upstream,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=20000, help="documents per language and side (en, de, zh)")
    ap.add_argument("--model-docs", type=int, default=600, help="documents for the own-model scorer")
    ap.add_argument("--workers", type=int, default=1, help="shard workers of the stage (the loop has one)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of loop and stage")
    ap.add_argument("--quick", action="store_true", help="the test suite's small run (seconds, not a figure)")
    a = ap.parse_args()
    if a.quick:
        a.docs, a.model_docs, a.rounds = 60, 40, 1
    clock = time.process_time if a.workers == 1 else time.perf_counter
    langs = ("en", "de", "zh")
    root = Path(tempfile.mkdtemp(prefix="llmpipe-bench-coherence-"))
    models = {lang: str(build_reference_model(documents(lang, 300, seed=1), lang, root / f"{lang}.arpa", 3))
              for lang in langs}
    n_nat = a.docs * 2 // 3
    docs = [d for lang in langs for d in labelled_corpus(lang, n_nat, (a.docs - n_nat) // 3)]
    for d in docs[:: max(1, len(docs) // 30)]:  # both sides start with the models and segmenters loaded
        kenlm_perplexity(load_kenlm(models[d.metadata["lang"]]), d.text, d.metadata["lang"])
    cfg = CoherenceConfig(enabled=True, kenlm_models=models)
    run_stage("coherence", cfg, docs[:30], root / "warm")  # imports (pyarrow, matplotlib) outside the timing
    loop_s, stage_s = [], []
    for r in range(a.rounds):  # interleaved: a burst of load on the machine hits one round of one side
        t0 = clock()
        for d in docs:
            lang = d.metadata["lang"]
            kenlm_perplexity(load_kenlm(models[lang]), d.text, lang)
        loop_s.append(clock() - t0)
        run_root = root / f"stage-{r}"  # a fresh store each round: no score is cached
        write_upstream(docs, run_root, shards=max(2, a.workers))  # the stage's input: the upstream's work
        t0 = clock()
        stats, _ = run_stage("coherence", cfg, docs, run_root, executor=LocalExecutor(a.workers),
                             upstream_written=True)
        stage_s.append(clock() - t0)
        print(f"round {r}: loop {loop_s[-1]:.3f} s, stage {stage_s[-1]:.3f} s")
    loop, stage = len(docs) / statistics.median(loop_s), len(docs) / statistics.median(stage_s)
    paired = statistics.median(lo / st for lo, st in zip(loop_s, stage_s, strict=True))
    print(f"{len(docs)} documents ({', '.join(langs)}; a third corrupted): kenlm.Model.score loop "
          f"{loop:,.0f} docs/s, coherence stage {stage:,.0f} docs/s (medians of {a.rounds} interleaved rounds; "
          f"{a.workers} worker(s), {'CPU' if a.workers == 1 else 'wall'} seconds); rejected {stats['rejected']}")
    print(f"stage / loop per round: {', '.join(f'{lo / st:.3f}' for lo, st in zip(loop_s, stage_s, strict=True))}; "
          f"ratio of the best rounds {min(loop_s) / min(stage_s):.3f}")
    ckpt = train_tiny_lm(root / "lm")
    few = [d for lang in langs for d in labelled_corpus(lang, a.model_docs * 2 // 9, a.model_docs // 9)]
    t0 = clock()
    run_stage("coherence", CoherenceConfig(enabled=True, scorer="model", model=str(ckpt)), few, root / "model",
              shards=max(2, a.workers), executor=LocalExecutor(a.workers))
    print(f"own model (tiny Llama, CPU): {len(few) / (clock() - t0):,.1f} docs/s on {len(few)} documents")
    result("coherence_stage_vs_kenlm_loop", paired, ">=", 0.9)


if __name__ == "__main__":
    main()
