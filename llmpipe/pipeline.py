"""The DAG: which stage modules exist. Adding a stage is one line in ``STAGE_MODULES``.

Importing a module registers its stages (``llmpipe.stage.stage``); the order of the DAG comes from
each stage's declared inputs (a topological sort, ties broken by this list's order).
"""

from __future__ import annotations

import importlib

from llmpipe.stage import STAGES, StageSpec

STAGE_MODULES = [
    "llmpipe.ingest",
    "llmpipe.curation.stages",  # langid, quality, safety
    "llmpipe.curation.dedup.stage",  # exact + MinHash LSH dedup
    "llmpipe.curation.augment.stage",  # synonym, masked LM, back-translation, restructure, templates
    "llmpipe.tokenization.tokenizer",  # byte-level BPE train or load
    "llmpipe.tokenization.pack",  # tokenize: encode, split, mix, pack
    "llmpipe.training.stage",  # pretrain: torchrun / DeepSpeed workers
    "llmpipe.evaluation.stage",  # evaluate: ppl, bits/byte, accuracy, samples, regression table
    "llmpipe.quantization.stage",  # quantize: AWQ W4 / int8 dynamic behind the quality gate
    "llmpipe.serving.stage",  # deploy: Triton model repository, smoke and load test
]


def load_stages() -> dict[str, StageSpec]:
    """Import every stage module and return the registered stages in DAG order."""
    for mod in STAGE_MODULES:
        importlib.import_module(mod)
    return dict((s.name, s) for s in topological_order(STAGES))


def topological_order(stages: dict[str, StageSpec]) -> list[StageSpec]:
    order: list[StageSpec] = []
    seen: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in seen:
            return
        if name in path:
            raise ValueError(f"stage cycle: {' -> '.join(path + (name,))}")
        spec = stages.get(name)
        if spec is None:
            raise ValueError(f"stage {path[-1]!r} needs unknown stage {name!r}")
        for dep in spec.inputs:
            visit(dep, path + (name,))
        seen.add(name)
        order.append(spec)

    for name in stages:
        visit(name, ())
    return order
